"""A reward service for Keel's `http` environment, in the standard library only.

For each sample Keel POSTs {"prompt", "completion", "messages", "metadata"}; this service
answers named rewards: `on_topic` (1 when the completion names the record's `topic`, a
column of prompts.jsonl that reaches the service as metadata) and `short` (1 for at most
twelve words), and an `info` object Keel records with the sample.

    python3 examples/reward-service/server.py --port 8090
"""

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def score(sample):
    completion = sample.get("completion", "")
    topic = str(sample.get("metadata", {}).get("topic", ""))
    on_topic = 1.0 if topic and topic.lower() in completion.lower() else 0.0
    short = 1.0 if len(completion.split()) <= 12 else 0.0
    return {"rewards": {"on_topic": on_topic, "short": short}, "info": {"topic": topic, "words": len(completion.split())}}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            reply = {"results": [score(s) for s in body["samples"]]} if "samples" in body else score(body)
            status, payload = 200, json.dumps(reply).encode()
        except (ValueError, KeyError, TypeError) as e:
            status, payload = 400, json.dumps({"error": str(e)}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"reward service on http://{args.host}:{args.port}/score", flush=True)
    server.serve_forever()
