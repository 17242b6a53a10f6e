"""gcp-storage-emulator, one thread per connection: ``python tests/gcs_emulator.py PORT BUCKET``.

The package serves one connection at a time (``http.server.HTTPServer``): a client that holds a
connection open (the training process's tensorstore or gcsfs pool) stalls every other client, the
test's own reads included. Here each connection gets a thread, and the handlers, which share the
emulator's in-memory store, run one at a time behind a lock (the store is not thread-safe)."""

import sys
import threading
from functools import partial
from http import server as http_server

from gcp_storage_emulator import server as emulator

LOCK = threading.Lock()


class SerialHandler(emulator.RequestHandler):
    """Reads requests concurrently, handles them one at a time."""


for verb in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"):
    method = getattr(emulator.RequestHandler, f"do_{verb}", None)
    if method is not None:
        def locked(self, _method=method):
            with LOCK:
                return _method(self)
        setattr(SerialHandler, f"do_{verb}", locked)


def main() -> None:
    port, bucket = int(sys.argv[1]), sys.argv[2]
    storage = emulator.Storage(use_memory_fs=True)
    emulator.buckets.create_bucket(bucket, storage)
    httpd = http_server.ThreadingHTTPServer(("127.0.0.1", port), partial(SerialHandler, storage))
    httpd.daemon_threads = True
    httpd.serve_forever()


if __name__ == "__main__":
    main()
