"""A webhook endpoint on 127.0.0.1 for the tests: it checks every delivery's signature
with the ``standardwebhooks`` package and answers the statuses it is given in turn."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


class Receiver:
    """An endpoint that answers the statuses it is given in turn (then 200; 503 to all
    while ``refusing``) and records what it got, each signature checked against
    ``secret``, with its answer."""

    def __init__(self) -> None:
        self.secret = ""
        self.answers: list[int] = []
        self.refusing = False
        self.reply = b""  # the body of every answer
        self.got: list[dict[str, Any]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    Webhook(receiver.secret).verify(body, headers)
                    valid = True
                except WebhookVerificationError:
                    valid = False
                status = receiver.answers.pop(0) if receiver.answers else 200
                status = 400 if not valid else 503 if receiver.refusing else status
                receiver.got.append(
                    {"headers": headers, "body": json.loads(body), "valid": valid, "status": status}
                )
                self.send_response(status)
                self.send_header("content-length", str(len(receiver.reply)))
                self.end_headers()
                self.wfile.write(receiver.reply)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
