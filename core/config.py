"""The YAML configuration (DESIGN §6), shared by ``specgate serve`` and the gateway.

Values come from the YAML file, overridden by ``SPECGATE_<SECTION>__<KEY>`` environment
variables (e.g. ``SPECGATE_GATEWAY__PORT=9000``); a bad key or value is a ConfigError that
names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from core.errors import ConfigError
from core.names import Backend


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    draft: str = "builtin-draft"  # the draft model, any --model value
    draft_backend: Backend = Backend.LLAMA_CPP


class WorkerEntry(BaseModel):
    """One target in the federation; ``launch: true`` makes ``specgate serve`` start it."""

    model_config = ConfigDict(extra="forbid")

    name: str
    url: str  # base URL of the worker, e.g. http://127.0.0.1:8101
    weight: float = Field(default=1.0, ge=0)  # w_n before normalisation
    model: str = "builtin"  # what a launched worker loads
    backend: Backend = Backend.LLAMA_CPP
    launch: bool = True

    @property
    def port(self) -> int:
        from urllib.parse import urlparse

        port = urlparse(self.url).port
        if port is None:
            raise ConfigError(f"workers.{self.name}.url needs an explicit port to be launched: {self.url}")
        return port


class SpecgateConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECGATE_", env_nested_delimiter="__", extra="forbid")

    gateway: GatewayConfig = GatewayConfig()
    workers: list[WorkerEntry] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> SpecgateConfig:
        names = [w.name for w in self.workers]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique, got {names}")
        if self.workers and sum(w.weight for w in self.workers) <= 0:
            raise ValueError("worker weights must not all be 0")
        return self

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, env_settings: PydanticBaseSettingsSource, *args: Any, **kwargs: Any
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return env_settings, init_settings  # environment over the YAML file


def load_config(path: str | Path) -> SpecgateConfig:
    """Read, merge with the environment, validate. Raises ConfigError naming the bad key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping at the top")
    try:
        return SpecgateConfig(**data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"config {path}: {key}: {first['msg']}") from exc
