"""An edit to a served app, until its new answer: `ember serve`'s hot reload against stopping and restarting
`ember serve --no-watch` (what a user did before), side by side in one run.

    python bench/reload.py [--edits 5] [--record]

The app is a function whose answer comes from a local import; each edit rewrites that module. Hot reload is timed
from the save to the gateway's "reloaded" line and to the first call that answers with the new value (that call
starts the new version's fork server and replica); restart from the save to the new process's first new answer.
Prints a table; with --record writes bench/results/reload.{md,json} with the machine.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
APP = '''
import ember
import word

app = ember.App("reload")


@app.function(scaledown_window=60)
def say() -> str:
    return word.WORD
'''


def machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0]}


class Server:
    """`ember serve APP` in its own process group; its output lines are kept with the time each arrived."""

    def __init__(self, app: Path, home: Path, *args: str):
        self.home, self.lines = home, []
        self.process = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", str(app), "--port", "0", *args],
                                        env=os.environ | {"EMBER_HOME": str(home)}, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        while not (served := [line for _, line in self.lines if line.startswith("Ember is serving")]):
            if self.process.poll() is not None:
                raise RuntimeError("ember serve exited:\n" + "\n".join(line for _, line in self.lines))
            time.sleep(0.01)
        self.url = served[0].split(" at ")[-1].strip()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def client(self) -> httpx.Client:
        from ember.gateway.keys import KeyStore

        key = KeyStore(self.home / "ember.db").create("bench")[1]
        return httpx.Client(base_url=self.url, verify=str(self.home / "tls" / "ca.pem"), timeout=60,
                            headers={"Authorization": f"Bearer {key}"})

    def stop(self) -> None:
        os.killpg(self.process.pid, 15)
        self.process.wait(30)


def answer_until(client: httpx.Client, expected: str) -> float:
    while True:
        try:
            if client.post("/reload/say", json={}).json().get("result") == expected:
                return time.monotonic()
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.01)


def hot_reload(folder: Path, edits: int) -> tuple[list[float], list[float]]:
    redeployed, answered = [], []
    server = Server(folder / "app.py", folder / "home-watch")
    try:
        with server.client() as client:
            answer_until(client, "v0")
            for n in range(1, edits + 1):
                time.sleep(1.0)
                saved = time.monotonic()
                (folder / "word.py").write_text(f'WORD = "v{n}"\n')
                answered.append(answer_until(client, f"v{n}") - saved)
                reloaded = [t for t, line in server.lines if t >= saved and "reloaded app" in line]
                redeployed.append(reloaded[0] - saved)
    finally:
        server.stop()
    return redeployed, answered


def restart(folder: Path, edits: int) -> list[float]:
    answered = []
    home = folder / "home-restart"
    server = Server(folder / "app.py", home, "--no-watch")
    try:
        for n in range(edits + 1, 2 * edits + 1):
            server.stop()
            saved = time.monotonic()
            (folder / "word.py").write_text(f'WORD = "v{n}"\n')
            server = Server(folder / "app.py", home, "--no-watch")
            with server.client() as client:
                answered.append(answer_until(client, f"v{n}") - saved)
    finally:
        server.stop()
    return answered


def row(name: str, seconds: list[float]) -> dict:
    return {"strategy": name, "median_s": round(statistics.median(seconds), 3), "max_s": round(max(seconds), 3),
            "runs": len(seconds)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edits", type=int, default=5)
    parser.add_argument("--record", action="store_true", help="write bench/results/reload.{md,json}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "app.py").write_text(APP)
        (folder / "word.py").write_text('WORD = "v0"\n')
        redeployed, answered = hot_reload(folder, args.edits)
        restarted = restart(folder, args.edits)
    rows = [row("hot reload: save -> redeployed", redeployed), row("hot reload: save -> new answer", answered),
            row("restart ember serve: save -> new answer", restarted)]
    table = ["| strategy | median s | max s | runs |", "|---|---|---|---|"]
    table += [f"| {r['strategy']} | {r['median_s']} | {r['max_s']} | {r['runs']} |" for r in rows]
    print("\n".join(table))
    if args.record:
        results = HERE / "results"
        (results / "reload.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")
        (results / "reload.md").write_text(f"# Hot reload (`python bench/reload.py --edits {args.edits}`)\n\n"
                                           f"Machine: {json.dumps(machine())}\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
