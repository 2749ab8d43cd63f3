"""A `redis-server` child process on a free loopback port, for tests and `splitserve up`.

Nothing is persisted (no RDB snapshots, no AOF): the index is rebuilt from the pods whenever
Redis comes back empty, so a restart here behaves like a real Redis that lost its data, which
is exactly what the routing must survive. `restart()` keeps the port, so clients reconnect.

With `tls` (services/common/tls.py's TlsFiles) the server speaks TLS only on its port, and with
the files' CA it also asks clients for a certificate signed by it (mutual TLS); `url` is then a
`rediss://` URL carrying the CA (and the same certificate as the client's) for redis-py.

On Linux the server is started through splitserve.common.die_with_parent (as the supervisor's
children are), so it gets SIGTERM when the process that started it dies, even by SIGKILL: a
killed `splitserve up` or test run leaves no redis-server behind. The kernel ties that signal to
the starting thread, so start it from a thread that lives as long as the server should.
"""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import subprocess
import time
from urllib.parse import urlencode

from splitserve.common.ports import free_port
from splitserve.common.supervisor import dying_with_us
from splitserve.common.tls import TlsFiles

STARTUP_TIMEOUT_SECONDS = 10.0


class RedisServer:
    """Owns one redis-server process. Use as a context manager, or `start()` / `stop()`."""

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        password: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        # requirepass: clients must AUTH. Given on stdin, never on the command line (ps).
        self._password = password
        self.tls = tls
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.tls is None:
            return f"redis://{self.host}:{self.port}/0"
        query = {"ssl_ca_certs": self.tls.ca or self.tls.cert}
        if self.tls.ca is not None:  # mutual TLS: our client shows the same certificate
            query.update(ssl_certfile=self.tls.cert, ssl_keyfile=self.tls.key)
        return f"rediss://{self.host}:{self.port}/0?{urlencode(query)}"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not on PATH (scripts/install_deps.sh installs it), or pass "
                "--redis-url / set REDIS_URL to use a running Redis"
            )
        argv = [binary, "-", *self._listen_args(), "--bind", self.host, "--save", ""]
        argv += ["--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"]
        self._process = subprocess.Popen(
            dying_with_us(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert self._process.stdin is not None, "stdin is piped"
        config = "" if self._password is None else f'requirepass "{_quoted(self._password)}"\n'
        self._process.stdin.write(config.encode())
        self._process.stdin.close()  # redis-server reads its config from stdin until EOF
        self._wait_until_answering()
        return self

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        args = ["--port", "0", "--tls-port", str(self.port)]  # no plaintext port at all
        args += ["--tls-cert-file", self.tls.cert, "--tls-key-file", self.tls.key]
        args += ["--tls-ca-cert-file", self.tls.ca or self.tls.cert]
        return [*args, "--tls-auth-clients", "yes" if self.tls.ca is not None else "no"]

    def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while not _answers_ping(self.host, self.port, self.tls):
            assert self._process is not None, "start() set the process"
            if self._process.poll() is not None:
                assert self._process.stderr is not None, "start() pipes stderr"
                error = self._process.stderr.read().decode(errors="replace").strip()
                raise RuntimeError(f"redis-server exited at start on port {self.port}: {error}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer on port {self.port} in time")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, as a crash would: clients see their connections drop."""
        self._signal_and_wait(signal.SIGKILL)

    def stop(self) -> None:
        self._signal_and_wait(signal.SIGTERM)

    def restart(self) -> RedisServer:
        """A fresh, empty server on the same port."""
        self.kill()
        return self.start()

    def _signal_and_wait(self, sig: signal.Signals) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _answers_ping(host: str, port: int, tls: TlsFiles | None = None) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2) as raw:
            sock = (
                raw if tls is None else _client_context(tls).wrap_socket(raw, server_hostname=host)
            )
            sock.sendall(b"PING\r\n")
            # -NOAUTH: a server with requirepass answers too, just not before AUTH.
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:  # ssl.SSLError included
        return False


def _client_context(tls: TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=tls.ca or tls.cert)
    if tls.ca is not None:
        context.load_cert_chain(tls.cert, tls.key)
    return context


def _quoted(text: str) -> str:
    """`text` inside a redis.conf double-quoted string."""
    if any(ord(char) < 32 for char in text):
        raise ValueError("a Redis password must not contain control characters")
    return text.replace("\\", "\\\\").replace('"', '\\"')
