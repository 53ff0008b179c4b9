"""Secrets a function lists in `secrets=[...]`: one EMBER_HOME/secrets/NAME.env file (KEY=VALUE lines, mode 0600)
each, which a local replica reads into its environment (ember.runtime.worker.read_secrets). The admin API writes
them; a deploy checks that every secret its functions need is there before it starts anything."""
import os
from pathlib import Path

from ember.spec import ENV_NAME, MAX_ENV_VALUE, SECRET_NAME, FunctionSpec, env_value_ok


class SecretError(ValueError):
    """A secret name, key or value that cannot be stored; the message says which and why."""


class MissingSecret(ValueError):
    """A function needs a secret that is not set; the message names the command that sets it."""


class SecretStore:
    def __init__(self, folder: Path):
        self.folder = folder

    def _path(self, name: str) -> Path:
        if not SECRET_NAME.fullmatch(name):
            raise SecretError(f"secret names match {SECRET_NAME.pattern}; got {name[:100]!r}")
        return self.folder / f"{name}.env"

    def set(self, name: str, values: dict[str, str]) -> list[str]:
        """Replace secret `name` with `values`; returns its keys."""
        path = self._path(name)
        if not values:
            raise SecretError("a secret needs at least one KEY=VALUE")
        for key, value in values.items():
            if not ENV_NAME.fullmatch(key):
                raise SecretError(f"secret keys are environment variable names ({ENV_NAME.pattern}); got {key[:100]!r}")
            if "\n" in value or "\r" in value or not env_value_ok(value):   # a lone surrogate was a 500
                raise SecretError(f"the value of {key} must be one line of UTF-8 text of at most {MAX_ENV_VALUE} bytes "
                                  "without NUL")
        text = "".join(f"{key}={value}\n" for key, value in values.items())
        # Written beside the old file and renamed over it: a replica starting meanwhile reads one whole version.
        partial = path.with_suffix(".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(text)
        partial.replace(path)
        return sorted(values)

    def keys(self, name: str) -> list[str] | None:
        """The keys of secret `name` (never the values); None when it is not set."""
        path = self._path(name)
        if not path.is_file():
            return None
        lines = path.read_text(errors="replace").splitlines()
        return sorted({line.partition("=")[0].strip() for line in lines if "=" in line and not line.startswith("#")})

    def all(self) -> list[dict]:
        found = []
        for path in sorted(self.folder.glob("*.env")):
            if SECRET_NAME.fullmatch(path.stem):
                found.append({"name": path.stem, "keys": self.keys(path.stem), "updated": path.stat().st_mtime})
        return found

    def remove(self, name: str) -> bool:
        path = self._path(name)
        if not path.is_file():
            return False
        path.unlink()
        return True

    def check(self, app: str, specs: dict[str, FunctionSpec]) -> None:
        """Raise MissingSecret naming the first secret a function of `app` lists that is not set."""
        for unit, spec in specs.items():
            for name in spec.secrets:
                if not SECRET_NAME.fullmatch(name) or self.keys(name) is None:
                    raise MissingSecret(f"{app}/{unit} needs secret {name!r}, which is not set: run "
                                        f"`ember secrets set {name} KEY=VALUE ...` and deploy again")
