"""Load a local HF-format checkpoint (config.json + safetensors) into a `DecoderModel`.

Nothing is ever downloaded: the path must be a directory on this machine.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvtier.engine.config import ModelConfig
from kvtier.engine.model import DecoderModel, empty_model

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_HF_PREFIX = "model."
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def checkpoint_files(path: str | Path) -> list[Path]:
    """Return the safetensors files of a checkpoint directory (all shards of an index)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is not a local checkpoint directory (kvtier never downloads models)"
        )
    index = path / INDEX_FILE
    if index.exists():
        files = [path / name for name in _shard_names(index)]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shards: {json.dumps(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _shard_names(index: Path) -> list[str]:
    """Return the shard file names an index's `weight_map` names, sorted and each once.

    Raises ValueError naming the index unless it is JSON holding an object `weight_map`
    of tensor name -> a file name in the checkpoint directory (never a path elsewhere).
    """
    try:
        with index.open(encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # JSON is UTF-8
        raise ValueError(f"{index} is not valid JSON ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(
            f"{index} must hold a non-empty object weight_map (tensor name -> shard file)"
        )
    names = list(weight_map.values())  # a list or object among them cannot go in a set
    # As JSON, as the index holds them (`null`, `"../a"`), not as Python shows them.
    bad = sorted({json.dumps(n) for n in names if not isinstance(n, str) or Path(n).name != n})
    if bad:
        raise ValueError(f"{index}: weight_map names {', '.join(bad)}, not shard file names")
    return sorted(set(names))


def parameter_name(hf_name: str) -> str | None:
    """Return our parameter name for an HF tensor name, or None for a tensor we ignore."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if hf_name.startswith(_HF_PREFIX):
        return hf_name[len(_HF_PREFIX) :]
    return hf_name


def load_weights(model: DecoderModel, path: str | Path) -> None:
    """Copy every parameter of `model` from the checkpoint at `path`, casting dtypes.

    Raises ValueError on a file safetensors cannot read (truncated, corrupt; named, as
    safetensors' own error does not), an unknown tensor, a shape mismatch, a tensor that
    is not floating point, a parameter the checkpoint lacks, or one stored in two files
    (a stale shard beside a newer copy: which one is meant cannot be told). With tied
    embeddings a stored `lm_head.weight` is ignored.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, str] = {}  # parameter -> the file it came from
    for file in checkpoint_files(path):
        try:
            _load_file(file, model, params, loaded)
        except SafetensorError as exc:  # its message names no file: a shard of many
            raise ValueError(f"{file} is not a readable safetensors file ({exc})") from None
    missing = sorted(params.keys() - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks parameters: {missing}")
    logger.info("loaded %d tensors from %s", len(loaded), path)


def _load_file(
    file: Path, model: DecoderModel, params: dict[str, torch.nn.Parameter], loaded: dict[str, str]
) -> None:
    """Copy the tensors of one safetensors file into `params`, recording each in `loaded`."""
    with safe_open(str(file), framework="pt") as f:
        for hf_name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
            name = parameter_name(hf_name)
            if name is None or (name == "lm_head.weight" and model.lm_head is None):
                continue
            if name not in params:
                raise ValueError(f"{file.name}: tensor {hf_name!r} has no model parameter")
            if name in loaded:
                raise ValueError(
                    f"tensor {hf_name!r} is stored in both {loaded[name]} and {file.name};"
                    " remove the stale file"
                )
            tensor = f.get_tensor(hf_name)
            param = params[name]
            _check_tensor(file.name, hf_name, tensor, param)
            with torch.no_grad():
                param.copy_(tensor)
            loaded[name] = file.name


def _check_tensor(file: str, hf_name: str, tensor: torch.Tensor, param: torch.Tensor) -> None:
    """Raise ValueError unless `tensor` can be cast into `param`: the same shape, and a
    floating point dtype (an integer one is a quantized weight, not loadable by a cast)."""
    if tensor.shape != param.shape:
        raise ValueError(
            f"{file}: {hf_name} has shape {tuple(tensor.shape)}, the model "
            f"expects {tuple(param.shape)}"
        )
    if not tensor.dtype.is_floating_point:
        raise ValueError(
            f"{file}: {hf_name} is {tensor.dtype}, not floating point (quantized "
            "checkpoints are not supported)"
        )


def load_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> DecoderModel:
    """Build a model from the local checkpoint directory `path`, in eval mode."""
    checkpoint_files(path)  # fail on a non-local path before reading anything
    config = ModelConfig.from_hf_config(path, dtype)
    model = empty_model(config, device)
    load_weights(model, path)
    return model
