"""Small shared helpers: seeding, atomic writes, JSON logs."""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from llm_rlhf.core.errors import ConfigError


def seed_everything(seed: int, process_index: int = 0) -> int:
    """Seed python, numpy and torch (CPU and CUDA). Each process gets `seed + process_index`."""
    # Here, not at the top: the CLI imports this module before a command is chosen, and stays light.
    import numpy as np
    import torch

    s = seed + process_index
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return s


BF16_CHOICES = (True, False, "auto")


def auto_bf16() -> tuple[bool, str]:
    """Whether `bf16: auto` turns bf16 autocast on here, and why (a phrase for the logs).

    A CPU: on where it has the AMX-BF16 or AVX512-BF16 instructions that oneDNN's bf16 kernels use; without
    them (AVX2 only) bf16 is emulated, slower than float32, and rounds differently from the native kernels.
    A GPU: off. At the shapes of these recipes a PPO step on an H200 was slower under bf16 autocast than in
    float32 (the steps are bound by kernel launches and autocast adds casts: docs/guides/gpus.md); a larger
    model on a GPU gains from `bf16: true`."""
    import torch

    if torch.cuda.is_available():
        return False, "on a GPU auto stays float32 (set bf16: true for a large model)"
    cpu = getattr(torch, "cpu", None)
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return True, "the CPU has AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return True, "the CPU has AVX512-BF16"
    return False, "the CPU has neither AMX nor AVX512-BF16 (bf16 would be emulated)"


def resolve_bf16(value: bool | str, key: str = "bf16") -> tuple[bool, str]:
    """A config's `bf16` key (true, false or "auto") as the bool a run uses, and the phrase it logs: "auto" is
    `auto_bf16`'s choice; true and false are taken as they are."""
    if value not in BF16_CHOICES:
        raise ConfigError(f"config key '{key}': {value!r} must be true, false or auto")
    native, why = auto_bf16()
    on = native if value == "auto" else bool(value)
    return on, f"bf16 autocast {'on' if on else 'off'} ({key}: {str(value).lower()}; {why})"


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=float) + "\n")


def append_jsonl(path: str | Path, obj: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj, default=float) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def last_checkpoint(output_dir: str | Path, prefix: str) -> Path | None:
    """The newest checkpoint a stage wrote to output_dir/checkpoints, or None: prefix "step" for PPO's
    step-N folders, "checkpoint" for a Hugging Face Trainer's checkpoint-N (SFT, RM, DPO)."""
    folder = Path(output_dir) / "checkpoints"
    numbered = [p for p in folder.glob(f"{prefix}-*") if p.is_dir() and p.name[len(prefix) + 1 :].isdigit()]
    return max(numbered, key=lambda p: int(p.name[len(prefix) + 1 :]), default=None)


def temp_dir_beside(path: str | Path) -> Path:
    """A fresh hidden folder next to `path` (same filesystem, so a rename is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))


def replace_dir(tmp: Path, final: str | Path) -> None:
    """Move a completely written folder into place; an older folder of that name is removed first."""
    final = Path(final)
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def publish_files(src_dir: str | Path, dest_dir: str | Path) -> None:
    """Move every file of a finished temporary folder into `dest_dir` (each move atomic), then drop it."""
    src_dir, dest_dir = Path(src_dir), Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    for item in sorted(src_dir.iterdir()):
        target = dest_dir / item.name
        if item.is_dir():
            replace_dir(item, target)
        else:
            os.replace(item, target)
    shutil.rmtree(src_dir, ignore_errors=True)


def use_cpu_ddp_without_gpus() -> None:
    """Under `accelerate launch` with several processes on a machine without GPUs, ask accelerate for
    CPU data parallelism (gloo). Without this it picks DDP only when it sees CUDA devices and leaves
    every process alone with world size 1: N independent runs writing to the same folder.

    Launched with a DeepSpeed config, DeepSpeed runs for real (`run_deepspeed_on_cpu`).

    The process state is set up here, once: a bare `PartialState()` (which does not read
    ACCELERATE_USE_CPU) made before the first `Accelerator` would otherwise see world size 1."""
    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        from accelerate import PartialState

        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            run_deepspeed_on_cpu()  # DeepSpeed for real over gloo, not DDP in its place
        PartialState(cpu=os.environ["ACCELERATE_USE_CPU"].lower() in ("1", "true", "yes"))


def run_deepspeed_on_cpu() -> None:
    """Make `accelerate launch` with a DeepSpeed config run DeepSpeed on a machine without GPUs, as it does on
    GPUs. accelerate 1.15 turns DeepSpeed on only for an accelerator device; on a CPU (where `llm-rlhf` sets
    ACCELERATE_USE_CPU, `use_cpu_ddp_without_gpus`) it would leave plain DDP over gloo: a run launched
    with deepspeed_zero3.yaml would silently train something else. After
    `AcceleratorState.__init__` this does what accelerate's own DeepSpeed branch does: the plugin gets the
    launch's mixed precision (written into the DeepSpeed config's bf16/fp16 section) and is selected, the
    distributed type becomes DEEPSPEED (in the shared process state too), and accelerate's own
    `mixed_precision` becomes "no" (the engine casts). DeepSpeed's CPU accelerator then runs ZeRO over the
    existing gloo group. Its shared-memory all-reduce op, which DeepSpeed compiles with g++ at its first start
    on a machine (a minute here) and uses only for inference all-reduce (tensor parallelism), is not built.
    Without deepspeed installed: ModuleNotFoundError saying how to install it (`llm-rlhf` prints it as one
    line)."""
    try:
        # the module itself: `deepspeed.comm.torch` names the torch package that deepspeed.comm imports
        ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError as e:
        raise ModuleNotFoundError(
            "the accelerate config says distributed_type: DEEPSPEED, but deepspeed is not installed: "
            "pip install -e '.[deepspeed]'"
        ) from e
    import accelerate.state
    from accelerate.utils import DistributedType

    ds_comm_torch.build_shm_op = lambda: None  # see the docstring: not needed by ZeRO training
    state_class = accelerate.state.AcceleratorState
    if getattr(state_class.__init__, "runs_deepspeed_on_cpu", False):
        return
    original_init = state_class.__init__

    def init_with_deepspeed_on_cpu(self, *args, deepspeed_plugin=None, **kwargs):
        original_init(self, *args, deepspeed_plugin=deepspeed_plugin, **kwargs)
        if deepspeed_plugin is None or self.distributed_type != DistributedType.MULTI_CPU:
            return
        if isinstance(deepspeed_plugin, dict):
            raise ValueError("several DeepSpeed plugins are not supported on a machine without GPUs")
        deepspeed_plugin.set_mixed_precision(self._mixed_precision)
        deepspeed_plugin.select(_from_accelerator_state=True)
        self.deepspeed_plugins = deepspeed_plugin
        self._mixed_precision = "no"  # as accelerate does under DeepSpeed: the engine's config holds it
        self.distributed_type = DistributedType.DEEPSPEED
        accelerate.state.PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED

    init_with_deepspeed_on_cpu.runs_deepspeed_on_cpu = True
    state_class.__init__ = init_with_deepspeed_on_cpu


def several_processes() -> bool:
    """True in a process of a data-parallel run (`accelerate launch` or torchrun with world size > 1) once its
    process group exists; False for a single process, e.g. pytest calling `main` in its own process."""
    import torch.distributed as dist  # here: torch.distributed is missing from some torch builds

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def exit_process(code: int) -> NoReturn:
    """End this process with exit code `code`: `sys.exit`, but a process of a data-parallel run ends without
    the interpreter's finalization (`os._exit`).

    Why: gloo's C++ worker threads outlive the command and can need the GIL while the interpreter finalizes
    (to release a finished collective's tensors, pytorch PR #179291): that aborts the rank ("terminate called
    without an active exception", exit -6) after it wrote everything (1 in 30 tiny two-process runs here).
    `destroy_process_group()` does not end those threads: torch itself keeps the group alive
    (torch.distributed.nn.functional's defaults bind `group.WORLD` when it is imported after the group
    exists, as transformers' imports do; FSDP2's DeviceMesh stays in DTensor's sharding caches).
    `os._exit` skips finalization (and atexit handlers), so what they would do is done here: loggers
    closed (the stages close their own TensorBoard writers), wandb finished, stdout/stderr flushed.

    After a success (code 0) every process meets at a barrier first, so that none leaves while another still
    talks to it (after an error the others may never arrive)."""
    import logging

    import torch.distributed as dist

    if not several_processes():
        sys.exit(code)
    if code == 0:
        dist.barrier()
    wandb = sys.modules.get("wandb")  # only if the run imported it (report_to wandb)
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
