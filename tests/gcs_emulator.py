"""gcp-storage-emulator made faithful enough for checkpoints: ``python tests/gcs_emulator.py PORT BUCKET``.

Two gaps of the package are closed here, so that tests exercise the same protocol real GCS speaks:
- It serves one connection at a time (``http.server.HTTPServer``): a client that holds a connection
  open (the training process's tensorstore or gcsfs pool) stalls every other client. Here each
  connection gets a thread, and the handlers, which share the emulator's in-memory store, run one at
  a time behind a lock (the store is not thread-safe).
- It ignores generation preconditions and leaves the generation out of a download's headers.
  tensorstore's OCDBT writes its manifest with ``ifGenerationMatch`` and reads with
  ``ifGenerationNotMatch``, and our lease lock creates its object with ``ifGenerationMatch=0``; without
  them a second writer is never refused and reads now and then fail ("Malformed StorageGeneration").
  Here they behave as the GCS JSON API documents: 412 when a match fails, 304 when a read's
  generation is unchanged, and ``x-goog-generation`` on every media response.
"""

import sys
import threading
from functools import partial
from http import HTTPStatus
from http import server as http_server

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator.exceptions import NotFound

LOCK = threading.Lock()


def _generation(storage, bucket: str, name: str | None) -> int | None:
    """The live generation of an object, or None when there is none."""
    if not name:
        return None
    try:
        return int(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return None


def _object_name(request) -> str | None:
    if request.params and request.params.get("object_id"):
        return request.params["object_id"]
    if "name" in request.query:
        return request.query["name"][0]
    if "multipart" in request.query.get("uploadType", []):
        return (request.data.get("meta") or {}).get("name")
    return None


def _failed_precondition(request, live: int | None) -> HTTPStatus | None:
    """The answer GCS gives when a request's generation preconditions do not hold against the
    object's ``live`` generation (None: no object), else None."""
    match = request.query.get("ifGenerationMatch", [None])[0]
    not_match = request.query.get("ifGenerationNotMatch", [None])[0]
    if match is not None and (live or 0) != int(match):
        return HTTPStatus.PRECONDITION_FAILED  # 0 means "only if absent"
    if not_match is not None and live is not None and live == int(not_match):
        return HTTPStatus.NOT_MODIFIED if request.method == "GET" else HTTPStatus.PRECONDITION_FAILED
    return None


def preconditioned(handler):
    def handle(request, response, storage, *args, **kwargs):
        live = _generation(storage, request.params["bucket_name"], _object_name(request))
        refusal = _failed_precondition(request, live)
        if refusal is not None:
            response.status = refusal
            return None
        result = handler(request, response, storage, *args, **kwargs)
        if request.method == "GET" and live is not None and response.status in (HTTPStatus.OK,
                                                                                 HTTPStatus.PARTIAL_CONTENT):
            response["x-goog-generation"] = str(live)  # a read changes nothing: still the live one
            response["x-goog-metageneration"] = "1"
        return result
    return handle


for _, routes in emulator.HANDLERS:
    for verb, handler in list(routes.items()):
        if verb in ("GET", "POST", "DELETE") and handler.__module__.endswith("objects"):
            routes[verb] = preconditioned(handler)


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
