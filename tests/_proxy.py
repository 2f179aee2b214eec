"""A TCP proxy on 127.0.0.1 in front of a real server (the S3 server of the tests), that breaks
transfers off or refuses connections on demand: a flaky network or an outage, with the real
server and the real client library on either side."""

from __future__ import annotations

import threading


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server that, while ``cuts`` > 0, answers a
    ranged GET with its headers and the first bytes of the body, then drops the connection: a
    transfer that breaks off mid-body, as a flaky network does (the request itself succeeded).
    While ``down`` is set, every connection is closed as soon as it is accepted: an outage."""

    def __init__(self, target_port: int):
        import socket

        self.cuts = 0
        self.down = False
        self.refused = 0
        self.cut_done = 0
        self._target = target_port
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self._stop:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            if self.down:
                self.refused += 1
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self._target))
            threading.Thread(target=self._serve, args=(client, server), daemon=True).start()

    def _serve(self, client, server) -> None:
        cut = [False]

        def up():
            try:
                while data := client.recv(1 << 16):
                    head = data[:2048].lower()
                    if self.cuts > 0 and data.startswith(b"GET ") and b"\r\nrange:" in head:
                        self.cuts -= 1
                        cut[0] = True
                    server.sendall(data)
            except OSError:
                pass

        threading.Thread(target=up, daemon=True).start()
        sent = 0
        try:
            while data := server.recv(1 << 16):
                if cut[0] and sent + len(data) > 2000:
                    client.sendall(data[:max(0, 2000 - sent)])
                    self.cut_done += 1
                    break
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (client, server):
                try:
                    s.shutdown(2)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._stop = True
        self._sock.close()
