"""An OTLP/HTTP sink standing in for Jaeger: POST /v1/traces bodies are written, one file
each, under /data (named by arrival, with the content type's subtype as extension); GET on
the admin (14269) and UI (16686) ports answers how many were received."""

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DATA = os.environ.get("OTLP_SINK_DIR", "/data")
os.makedirs(DATA, exist_ok=True)


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("content-length", 0))
        body = self.rfile.read(length)
        kind = self.headers.get("content-type", "application/octet-stream").split("/")[-1]
        name = f"{time.time_ns()}-{threading.get_ident()}.{kind}"
        with open(os.path.join(DATA, name + ".part"), "wb") as out:
            out.write(body)
        os.rename(os.path.join(DATA, name + ".part"), os.path.join(DATA, name))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        received = sum(1 for name in os.listdir(DATA) if not name.endswith(".part"))
        body = json.dumps({"status": "Server available", "requests": received}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


for port, handler in ((4318, Receiver), (14269, Health), (16686, Health)):
    server = ThreadingHTTPServer(("0.0.0.0", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
threading.Event().wait()
