"""Tests against the real upstream vllm-ascend package (pytest marker ``packaging``)."""
