"""A moto_server process (the local AWS API emulator) on a free port, and the environment boto3 reads to use it."""
import contextlib
import re
import subprocess
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Yields the emulator's endpoint URL; the process is stopped on exit. It binds a port of its own choosing and
    says which: a port picked here and handed over could be taken meanwhile by another test's server, which then
    answered the S3 calls (404s)."""
    proc = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", "0"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = _listening_url(proc)
        # it logs every request on stderr: drained, so a full pipe never blocks it
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _listening_url(proc: subprocess.Popen) -> str:
    """The URL from the server's "Running on http://HOST:PORT" line, within 30 s."""
    assert proc.stderr is not None
    found: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            match = re.search(r"Running on (http://[\d.]+:\d+)", line)
            if match:
                found.append(match.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    if not found:
        raise RuntimeError(f"moto_server did not start (exit code {proc.poll()})")
    return found[0]


def aws_env(endpoint: str) -> dict[str, str]:
    """Dummy credentials and the emulator's endpoint, as boto3 reads them from the environment."""
    return {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
