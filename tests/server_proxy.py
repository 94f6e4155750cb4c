"""A fault-injecting HTTP proxy in front of a real inference server (tests only): it forwards every
request to the server and, for the installs named in `faults` (0 = the first
`echo2_install_file` call), breaks one:

- "refuse": the digest is changed before forwarding, so the server refuses the file before
  touching a weight (the worker keeps the version it had);
- "lost": the server installs, but the worker is answered 500 (the worker cannot know what is
  served and claims -1 until its retry installs again).

It records each install's outcome and every version the server was told to serve."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer

import httpx
from server_stub import JSONHandler


class FaultProxy:
    def __init__(self, upstream: str, faults: dict[int, str]) -> None:
        if upstream.startswith("unix:"):
            self.client = httpx.Client(
                transport=httpx.HTTPTransport(uds=upstream[5:]), base_url="http://server"
            )
        else:
            self.client = httpx.Client(base_url=upstream)
        self.faults = dict(faults)
        self.installs: list[str] = []  # per echo2_install_file call: "ok", "refuse" or "lost"
        self.versions: list[str] = []  # update_weight_version bodies the server answered 200
        self.lock = threading.Lock()

    def forward(self, method: str, path: str, body: bytes, headers: dict) -> tuple[int, bytes]:
        fault = None
        if path == "/collective_rpc" and body:
            call = json.loads(body)
            if call.get("method") == "echo2_install_file":
                with self.lock:
                    fault = self.faults.get(len(self.installs), "ok")
                    self.installs.append(fault)
                if fault == "refuse":
                    call["args"][1] = "0" * 64
                    body = json.dumps(call).encode()
        reply = self.client.request(method, path, content=body or None, headers=headers, timeout=300)
        if path == "/update_weight_version" and reply.status_code == 200:
            with self.lock:
                self.versions.append(json.loads(body)["new_version"])
        if fault == "lost":
            return 500, json.dumps({"error": {"message": "proxy: the reply was lost"}}).encode()
        return reply.status_code, reply.content

    def start(self) -> str:
        proxy = self

        class Handler(JSONHandler):
            def _serve(self, method):
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                wanted = ("content-type", "authorization")
                headers = {k: v for k, v in self.headers.items() if k.lower() in wanted}
                self.reply(*proxy.forward(method, self.path, body, headers))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()
