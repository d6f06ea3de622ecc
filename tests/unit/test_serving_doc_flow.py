"""The client flow of docs/serving_events_metrics.md (curl + jq) asks the
server which model it serves. Here it runs against a stand-in server that
serves a model of another name than the repo's generated ones and, as vLLM
does, answers 404 for any other name: both completions come back, the
prefix-cache reset succeeds and the metrics lines print. The same flow
against a real server: tests/e2e/test_serve.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.conftest import run_serving_doc_flow

SERVED = "org/served-model"
PROMPT_TOKENS = 600  # the doc's make_prompt(600, ...)
METRICS = (
    'vllm:kv_offload_store_bytes_total{engine="0",model_name="m"} 262144.0\n'
    'vllm:kv_offload_load_bytes_total{engine="0",model_name="m"} 262144.0\n'
)


class StandIn(BaseHTTPRequestHandler):
    """The endpoints the flow calls, answering as vLLM's server does."""

    def reply(self, status: int, body: dict | str) -> None:
        data = body if isinstance(body, str) else json.dumps(body)
        self.send_response(status)
        self.end_headers()
        self.wfile.write(data.encode())

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": SERVED}]})
        elif self.path == "/metrics":
            self.reply(200, METRICS)
        else:
            self.reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/reset_prefix_cache":
            self.reply(200, {"success": True})
        elif self.path == "/v1/completions":
            request = json.loads(body)
            if request["model"] != SERVED:
                error = f"The model `{request['model']}` does not exist."
                self.reply(404, {"error": {"message": error, "code": 404}})
                return
            tokens = len(request["prompt"].split())
            usage = {"prompt_tokens": tokens, "completion_tokens": 1}
            self.reply(200, {"choices": [{"text": " kuke"}], "usage": usage})
        else:
            self.reply(404, {"detail": "Not Found"})

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def stand_in() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_flow_asks_for_the_served_model_and_gets_completions(stand_in):
    flow = run_serving_doc_flow(stand_in)
    if flow is None:
        pytest.skip("curl or jq is not installed")
    assert len(flow.completions) == 2, flow.output
    for reply in flow.completions:
        assert "error" not in reply, reply
        assert reply["text"] and reply["usage"]["prompt_tokens"] == PROMPT_TOKENS
    assert flow.resets == [{"success": True}]
    assert [m.split("{")[0] for m in flow.metrics] == [
        "vllm:kv_offload_store_bytes_total",
        "vllm:kv_offload_load_bytes_total",
    ]
