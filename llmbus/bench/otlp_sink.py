"""`python -m llmbus.bench.otlp_sink`: an OTLP/HTTP endpoint that accepts traces and counts
spans, so the cost of tracing can be measured without running a collector."""

from __future__ import annotations

import argparse
import http.server
import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    count = [0]
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            request = ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            spans = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            with lock:
                count[0] += spans
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"OTLP sink on http://127.0.0.1:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        print(f"received {count[0]} spans", flush=True)


if __name__ == "__main__":
    main()
