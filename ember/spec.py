"""FunctionSpec: every setting of a function or class, checked when the app is loaded."""
import difflib
import os
import re
from typing import Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# A GPU type of up to 32 characters and up to 8 of them: the GPUs of one host (a count of 10**20 was taken, and
# its replica could never be placed)
GPU_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,31}(:[1-8])?$")
SECRET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
MAX_ENV_VALUE = 64 * 1024  # bytes in one environment value (a secret's or env=)
DAY = 86400.0              # the longest call, idle window or park delay a function may ask for
MOST_REPLICAS = 10_000     # replicas or concurrent calls of one function: more is a typo, and would be started


def env_value_ok(text: str) -> bool:
    """Whether an environment can hold `text` as a value: UTF-8 text (no lone surrogate, which a JSON string can
    escape) of at most MAX_ENV_VALUE bytes, without NUL."""
    try:
        return "\0" not in text and len(text.encode()) <= MAX_ENV_VALUE
    except UnicodeEncodeError:
        return False


class SpecError(ValueError):
    """A decorator argument is wrong; the message names the argument and the fix."""


class Retries(BaseModel):
    """How often a failed call runs again, and the backoff between attempts: the n-th retry waits
    min(initial_delay * backoff_coefficient ** (n - 1), max_delay) seconds. A call is retried when the function
    raised or its replica was lost mid-call, never after it returned a result."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_retries: int = Field(ge=0, le=10)
    backoff_coefficient: float = Field(2.0, ge=1.0, le=10.0)
    initial_delay: float = Field(1.0, ge=0.0, le=60.0, description="seconds before the first retry")
    max_delay: float = Field(60.0, ge=0.0, le=600.0, description="seconds any retry waits at most")

    def __init__(self, max_retries: int, backoff_coefficient: float = 2.0, initial_delay: float = 1.0,
                 max_delay: float = 60.0, **kwargs: Any):
        super().__init__(max_retries=max_retries, backoff_coefficient=backoff_coefficient,
                         initial_delay=initial_delay, max_delay=max_delay, **kwargs)

    def __reduce__(self):
        return (type(self).model_validate, (self.model_dump(),))

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1 for the first)."""
        return min(self.initial_delay * self.backoff_coefficient ** (retry - 1), self.max_delay)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu: str | None = None
    # Every number is finite and bounded: an infinite timeout failed every call with a 500 in the gateway, and
    # min_replicas=10**6 would start a million replicas
    cpu: float = Field(1.0, gt=0, le=1024, allow_inf_nan=False)
    memory: int = Field(1024, gt=0, le=16 * 1024 * 1024, description="MiB")
    min_replicas: int = Field(0, ge=0, le=MOST_REPLICAS)
    max_replicas: int = Field(10, ge=1, le=MOST_REPLICAS)
    buffer_replicas: int = Field(0, ge=0, le=MOST_REPLICAS)
    scaledown_window: float | None = Field(
        None, gt=0, le=DAY, allow_inf_nan=False,
        description="idle seconds before a replica is stopped (default: 90 s, or 600 s once parked)")
    park: bool = Field(True, description="park idle replicas (GPU freed, process kept) where a wake is fast")
    park_after: float | None = Field(
        None, gt=0, le=DAY, allow_inf_nan=False,
        description="idle seconds before a replica parks (default: learned from its measured wakes)")
    stable_window: float | None = Field(None, gt=0, le=DAY, allow_inf_nan=False,
                                        description="seconds of load that size steady traffic (default 60)")
    panic_window: float | None = Field(None, gt=0, le=DAY, allow_inf_nan=False,
                                       description="seconds of load that detect a burst (default 6)")
    panic_threshold: float = Field(2.0, gt=1, le=1000, allow_inf_nan=False,
                                   description="a burst is this many times the hot replicas' target load")
    # "hooks": torch modules move to host and @ember.park()/@ember.wake() release the rest; "cuda-checkpoint": the
    # driver moves all of the process's GPU state to host (for CUDA code that cannot cooperate; slower)
    park_with: Literal["hooks", "cuda-checkpoint"] = "hooks"
    target_concurrency: float = Field(1.0, gt=0, le=MOST_REPLICAS, allow_inf_nan=False)
    max_concurrency: int = Field(1, ge=1, le=MOST_REPLICAS)
    timeout: float = Field(300.0, gt=0, le=DAY, allow_inf_nan=False, description="seconds one call may run")
    retries: int | Retries = Field(
        0, validate_default=True,
        description="times the gateway may run a call again when the function raised or its replica was lost "
                    "mid-call (an int N: Retries(N, backoff_coefficient=1.0), a retry a second after the last); "
                    "0 (at most once) unless it is safe to run twice")
    queue_bound: int = Field(256, ge=1, le=1_000_000,
                             description="calls that may wait for a replica before 503 + Retry-After")
    snapshot: bool = False
    secrets: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    requirements: list[str] = Field(default_factory=list, description="pip requirements installed for this function "
                                    "alone, into a cached environment that shares everything installed here")

    def __reduce__(self):
        # pydantic pickles the set of fields given, in hash-seed order; rebuilding from the values
        # in field order keeps a package's bytes, and so its content hash, the same in every process.
        return (type(self).model_validate, (self.model_dump(),))

    @property
    def retry_policy(self) -> Retries:
        """`retries` as validation left it: always a Retries."""
        assert isinstance(self.retries, Retries)
        return self.retries

    @field_validator("retries", mode="after")
    @classmethod
    def _retry_policy(cls, value: int | Retries) -> Retries:
        if isinstance(value, Retries):
            return value
        if not 0 <= value <= 10:
            raise ValueError(f"retries must be from 0 to 10, got {value}")
        return Retries(value, backoff_coefficient=1.0)

    @field_validator("env")
    @classmethod
    def _environment(cls, value: dict[str, str]) -> dict[str, str]:
        # Checked here, not when a replica starts: there os.environ refused them and every call got a 503
        for key, text in value.items():
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"env keys are environment variable names ({ENV_NAME.pattern}); got {key[:100]!r}")
            if not env_value_ok(text):
                raise ValueError(f"the value of env {key} must be UTF-8 text of at most {MAX_ENV_VALUE} bytes "
                                 "without NUL")
        return value

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not SECRET_NAME.fullmatch(name):
                raise ValueError(f"secret names match {SECRET_NAME.pattern}; got {name[:100]!r}")
        return value

    @field_validator("gpu")
    @classmethod
    def _gpu_shape(cls, value: str | None) -> str | None:
        if value is not None and not GPU_PATTERN.match(value):
            raise ValueError(f"gpu must look like 'H200' or 'H200:2' (1 to 8 GPUs of one host), got {value[:40]!r}")
        return value

    @field_validator("requirements")
    @classmethod
    def _requirements(cls, value: list[str]) -> list[str]:
        return check_requirements(value)

    @model_validator(mode="after")
    def _ranges(self) -> "FunctionSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        window = self.scaledown_window
        if self.park_after is not None and window is not None and self.park_after >= window:
            raise ValueError(
                f"park_after ({self.park_after:g}) must be < scaledown_window ({window:g}): "
                "a replica parks first and is stopped when the window ends"
            )
        if self.park_after is not None and not self.park:
            raise ValueError(
                f"park_after ({self.park_after:g}) needs park=True: with park=False an idle replica never parks (it "
                "stops after scaledown_window); drop park_after or park=False"
            )
        if self.panic_window is not None and self.stable_window is not None and self.panic_window > self.stable_window:
            raise ValueError(
                f"panic_window ({self.panic_window:g}) must be <= stable_window ({self.stable_window:g}): "
                "a burst is measured over a shorter window than steady load"
            )
        if self.target_concurrency > self.max_concurrency:
            raise ValueError(
                f"target_concurrency ({self.target_concurrency}) must be <= max_concurrency ({self.max_concurrency})"
            )
        return self


class Settings(TypedDict, total=False):
    """The decorator keywords of @app.function() and @app.cls(), for editors and type checkers; FunctionSpec is
    what checks them (with the nearest name for a typo). tests/ember/test_spec.py keeps the two in step."""

    gpu: str | None
    cpu: float
    memory: int
    min_replicas: int
    max_replicas: int
    buffer_replicas: int
    scaledown_window: float | None
    park: bool
    park_after: float | None
    stable_window: float | None
    panic_window: float | None
    panic_threshold: float
    park_with: Literal["hooks", "cuda-checkpoint"]
    target_concurrency: float
    max_concurrency: int
    timeout: float
    retries: int | Retries
    queue_bound: int
    snapshot: bool
    secrets: list[str]
    env: dict[str, str]
    requirements: list[str]


PATH_SUFFIXES = (".whl", ".tar.gz", ".zip")


def check_requirements(requirements: list[str]) -> list[str]:
    """Each a pip requirement ('name[extra]>=1.0', 'name @ URL') or a local path (a project folder, a wheel or an
    sdist; a relative one is taken from the current directory and made absolute here)."""
    from packaging.requirements import InvalidRequirement, Requirement

    checked = []
    for i, text in enumerate(requirements):
        text = text.strip()
        if text.startswith((".", "/", "~")) or os.sep in text.split("@")[0] or text.endswith(PATH_SUFFIXES):
            path = os.path.abspath(os.path.expanduser(text))
            if not os.path.exists(path):
                raise ValueError(f"requirements[{i}]: no file or folder at {path}; give an existing project folder, "
                                 "wheel or sdist, or a pip requirement such as 'requests>=2'")
            checked.append(path)
            continue
        try:
            Requirement(text)
        except InvalidRequirement as exc:
            reason = str(exc).splitlines()[0]
            raise ValueError(f"requirements[{i}] {text!r} is not a pip requirement ({reason}); write it as in "
                             "requirements.txt, e.g. 'requests>=2' or 'name @ https://...'") from None
        checked.append(text)
    return checked


def build_spec(decorator: str, kwargs: dict[str, Any]) -> FunctionSpec:
    """Validate decorator kwargs; unknown names get the nearest valid one suggested."""
    valid = list(FunctionSpec.model_fields)
    for name in kwargs:
        if name not in valid:
            near = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid arguments: {', '.join(valid)}"
            raise SpecError(f"unknown argument {name!r} for {decorator}{hint}")
    try:
        return FunctionSpec(**kwargs)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise SpecError(f"invalid settings for {decorator}: {problems}") from None
