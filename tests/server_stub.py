"""A recording stand-in for an inference server's HTTP routes (vLLM 0.32's and SGLang's), for the
server engine's hermetic tests: it answers each route with the shape the real server gives
(../shared/notes/server-engines.md; SGLang: docs/engines.md), records every request, and fails on
command (`faults`). Not a model: a completion's tokens are the last prompt id + 1, + 2, ...

In process: `Stub.start()` (127.0.0.1, port 0). As a process: `python tests/server_stub.py --uds
PATH`, for the launch and server-death tests."""

from __future__ import annotations

import json
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from echo2.rollout.install_digest import file_digest


class JSONHandler(BaseHTTPRequestHandler):
    """GET and POST go to `_serve(method)`, which answers with `reply`; nothing is logged (the
    stub's and the fault proxy's, tests/server_proxy.py)."""

    protocol_version = "HTTP/1.1"

    def _serve(self, method: str) -> None:
        raise NotImplementedError

    def reply(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def log_message(self, *args):
        pass


class Stub:
    def __init__(
        self, *, logprobs_mode: str = "processed_logprobs", processors: tuple[str, ...] = ()
    ) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.faults: dict[str, str] = {}
        """route -> "500" (answer 500), "untouched" (an install refused before loading), "hang"."""
        self.settings = {
            "logprobs_mode": logprobs_mode,
            "logits_processors": list(processors),
            "dtype": "float32",
        }
        self.version: str | None = None
        self.paused = False
        self.installed: list[str] = []
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ routes
    def handle(self, method: str, path: str, query: dict, body: dict | None) -> tuple[int, dict]:
        with self.lock:
            self.calls.append((path, body if body is not None else query))
        fault = self.faults.get(path)
        if fault == "500":
            return 500, {"error": {"message": "injected", "code": 500}}
        if path == "/health":
            return 200, {}
        if path == "/version":
            return 200, {"version": "0.32.0"}
        if path == "/v1/models":
            return 200, {"data": [{"id": "stub-model"}]}
        if path == "/v1/completions":
            return 200, self.complete(body or {})
        if path in ("/pause", "/pause_generation"):
            self.paused = True
            return 200, {"status": "paused"}
        if path in ("/resume", "/continue_generation"):
            self.paused = False
            return 200, {"status": "resumed"}
        if path == "/is_paused":
            return 200, {"is_paused": self.paused}
        if path == "/reset_prefix_cache":
            return 200, {"success": True}
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {"success": True, "new_version": self.version}
        if path in ("/weight_info", "/get_weight_version"):
            return 200, {"weight_version": self.version}
        if path == "/get_model_info":
            return 200, {"model_path": "stub-model"}
        if path == "/update_weights_from_disk":
            if fault == "refuse":  # http_server.py: 400 with success false
                return 400, {"success": False, "message": "Failed to get weights iterator: no such file"}
            if fault == "rollback":
                msg = "Failed to update weights: shape.\nRolling back to original weights."
                return 400, {"success": False, "message": msg, "num_paused_requests": 0}
            self.version = body.get("weight_version")
            self.installed.append(body["model_path"])
            return 200, {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        if path == "/collective_rpc":
            return self.rpc(body or {})
        return 404, {"detail": "Not Found"}

    def complete(self, body: dict) -> dict:
        prompt, n = body["prompt"], body.get("n", 1)
        length = min(3, body["max_tokens"])
        choices = []
        for j in range(n):
            ids = [(prompt[-1] + 1 + j + t) % 1000 for t in range(length)]
            choices.append(
                {
                    "index": j,
                    "token_ids": ids,
                    "prompt_token_ids": prompt,
                    "logprobs": {"token_logprobs": [-0.5] * length},
                    "text": "",
                }
            )
        return {"choices": choices}

    def rpc(self, body: dict) -> tuple[int, dict]:
        method, args = body.get("method"), body.get("args", [])
        if method == "echo2_settings":
            return 200, {"results": [self.settings]}
        if method == "echo2_packed_modules":
            return 200, {"results": [{}]}
        if method == "echo2_install_file":
            if self.faults.get("install") == "untouched":
                return 500, {"error": {"message": "echo2-untouched: digest differs"}}
            if self.faults.get("install") == "500":
                return 500, {"error": {"message": "Worker failed with error 'shape mismatch'"}}
            path, sha = args[0], args[1]
            digest = file_digest(path)
            self.installed.append(path)
            mismatched = ["model.norm.weight"] if self.faults.get("install") == "mismatch" else []
            return 200, {"results": [{"count": 3, "digest": digest if digest == sha else "x", "checked": 2,
                                      "mismatched": mismatched}]}  # fmt: skip
        return 500, {"error": {"message": f"no attribute {method!r}"}}

    # ------------------------------------------------------------------ serving
    def handler(self):
        stub = self

        class Handler(JSONHandler):
            def _serve(self, method):
                parts = urlsplit(self.path)
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                status, reply = stub.handle(method, parts.path, query, body)
                self.reply(status, json.dumps(reply).encode())

            def address_string(self):
                return "stub"

        return Handler

    def start(self) -> str:
        """Serve on 127.0.0.1 (a free port) in a thread; returns the url."""
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def main(argv: list[str]) -> int:
    path = argv[argv.index("--uds") + 1]
    server = _UnixHTTPServer(path, Stub().handler())
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
