"""HTTP/1.x over a plain socket, for what HTTP client libraries will not send: pipelined requests,
half-closes, malformed heads, slow or idle clients."""

import json
import socket
import time


def request_bytes(method, path, body=None, headers=None, version="HTTP/1.1", content_type="application/json"):
    """One request. body: a dict (sent as JSON), bytes, or None. headers: extra lines, name -> value."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    lines = [f"{method} {path} {version}", "Host: localhost"]
    if body is not None and content_type:
        lines.append(f"Content-Type: {content_type}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


class Response:
    def __init__(self, status, headers, body, interim):
        self.status, self.headers, self.body, self.interim = status, headers, body, interim

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"Response({self.status}, {self.headers}, {self.body[:300]!r})"


class Conn:
    """One client connection; responses are read in order from a shared buffer (pipelining)."""

    def __init__(self, port, timeout=10):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def send(self, data):
        self.sock.sendall(data)

    def shutdown_write(self):
        self.sock.shutdown(socket.SHUT_WR)

    def close(self):
        self.sock.close()

    def _fill(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("connection closed by the server")
        self.buf += chunk

    def _take(self, n):
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def response(self):
        """The next final response (1xx interim responses are collected in .interim)."""
        interim = []
        while True:
            while b"\r\n\r\n" not in self.buf:
                self._fill()
            head, self.buf = self.buf.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {}
            for line in lines[1:]:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
            if 100 <= status < 200:
                interim.append(status)
                continue
            break
        if "content-length" in headers:
            body = self._take(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(self._line().split(b";")[0], 16)
                if size == 0:
                    self._line()
                    break
                body += self._take(size)
                self._take(2)
        else:  # until the server closes
            try:
                while True:
                    self._fill()
            except EOFError:
                pass
            body, self.buf = self.buf, b""
        return Response(status, headers, body, interim)

    def closed_by_server(self, timeout):
        """True when the server closes the connection (EOF or reset) within timeout seconds."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False


def exchange(port, data, shut_wr=False, timeout=10):
    """Sends data on a new connection and returns its first final response."""
    c = Conn(port, timeout=timeout)
    try:
        c.send(data)
        if shut_wr:
            c.shutdown_write()
        return c.response()
    finally:
        c.close()


def timed(f, *args, **kw):
    t0 = time.time()
    out = f(*args, **kw)
    return out, time.time() - t0
