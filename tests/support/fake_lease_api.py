"""A small fake of the Kubernetes Lease REST API (coordination.k8s.io/v1), real HTTP on
127.0.0.1, for the Kubernetes backend's tests.

What it keeps of the real API server: get/list/create/update/delete on
``/apis/coordination.k8s.io/v1/namespaces/<ns>/leases[/<name>]``, a resourceVersion bumped on
every write, 404 for a missing Lease, 409 for a create of an existing one and for an update
carrying a stale resourceVersion (optimistic concurrency). What it does not: authentication,
RBAC (it records the verb of every call instead, for the test of the Role), watches, field
validation. ``fail_with`` makes every call answer that HTTP status.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATH = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/leases(?:/(?P<name>[^/?]+))?(?:\?.*)?$")
VERBS = {"GET": "get", "POST": "create", "PUT": "update", "DELETE": "delete"}


class FakeLeaseApi:
    def __init__(self) -> None:
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.verbs: list[str] = []
        self.fail_with: int | None = None
        self._rv = 0
        self._lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, doc: dict[str, Any]) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                m = PATH.match(self.path)
                if m is None:
                    return self._answer(404, _status(404, "NotFound", self.path))
                status, doc = api.handle(self.command, m["ns"], m["name"], body)
                self._answer(status, doc)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def handle(self, method: str, ns: str, name: str | None, body: Any) -> tuple[int, dict[str, Any]]:
        with self._lock:
            verb = "list" if method == "GET" and name is None else VERBS.get(method, method)
            self.verbs.append(verb)
            if self.fail_with is not None:
                return self.fail_with, _status(self.fail_with, "InternalError", "injected")
            if verb == "list":
                items = [v for (n, _), v in sorted(self.leases.items()) if n == ns]
                return 200, {"kind": "LeaseList", "apiVersion": "coordination.k8s.io/v1",
                             "metadata": {"resourceVersion": str(self._rv)}, "items": items}  # fmt: skip
            if verb == "create":
                name = body["metadata"]["name"]
                if (ns, name) in self.leases:
                    return 409, _status(409, "AlreadyExists", f'leases "{name}" already exists')
                return 201, self._store(ns, name, body)
            current = self.leases.get((ns, name))
            if current is None:
                return 404, _status(404, "NotFound", f'leases "{name}" not found')
            if verb == "get":
                return 200, current
            if verb == "delete":
                del self.leases[(ns, name)]
                return 200, _status(200, "Success", "deleted")
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if rv != current["metadata"]["resourceVersion"]:
                return 409, _status(409, "Conflict", "the object has been modified")
            return 200, self._store(ns, name, body)

    def _store(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        doc = {**body, "kind": "Lease", "apiVersion": "coordination.k8s.io/v1"}
        doc["metadata"] = {**body.get("metadata", {}), "name": name, "namespace": ns, "resourceVersion": str(self._rv)}
        self.leases[(ns, name)] = doc
        return doc

    def __enter__(self) -> FakeLeaseApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure" if code >= 400 else "Success",
            "reason": reason, "message": message, "code": code}  # fmt: skip
