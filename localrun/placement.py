"""Which device runs each part of the model: layerplan's plan turned into a `DeviceMap`.

A DeviceMap names, per repeating layer, the device that holds its weights and KV cache, and
the device group it belongs to, and, when layerplan made it, the bytes each device's KV pool
may take (the plan's KV plus the headroom it leaves there: what `localrun plan` prints is what
the engine allocates); the model moves its activations to the next group's device
exactly where the group changes (once per boundary). Groups, not devices, mark the boundaries
so that a map with two groups that are both the CPU runs the boundary code on machines
without a GPU (the tests do that).

`--gpu-layers` counts as llama.cpp's -ngl (the last N layers; n_layers + 1 adds the output
head); 'auto' lets layerplan choose, which on a machine without a GPU is all-CPU (still a
plan: it sizes the host's KV pool).
Plain Python: imports neither torch nor the model.
"""
from __future__ import annotations

from dataclasses import dataclass

from layerplan.kv_cache import DEFAULT_KV_TYPE
from localrun.errors import OptionError, UserError

HOST = "cpu"


@dataclass(frozen=True)
class DeviceMap:
    layer_devices: tuple[str, ...]     # per layer: "cpu", "cuda:0", ...
    layer_groups: tuple[int, ...]      # per layer: its device group (a boundary wherever this changes)
    head_device: str = HOST            # final norm + output head (+ logits)
    head_group: int = -1               # -1: the host's group
    embedding_device: str = HOST       # the token table is a lookup: it stays in host memory
    embedding_group: int = -1
    summary: str = ""
    kv_budget: tuple[tuple[str, int], ...] = ()   # (device, bytes) for each device holding KV;
                                                   # (): no plan, the engine's share of free memory

    def kv_budget_on(self, device: str) -> int | None:
        """The plan's KV bytes for `device` ('cpu', 'cuda:0'), None without a plan."""
        return dict(self.kv_budget).get(device) if self.kv_budget else None

    @property
    def n_gpu_layers(self) -> int:
        return sum(d != HOST for d in self.layer_devices) + int(self.head_device != HOST)

    def boundaries(self) -> int:
        """How many times one forward moves the activations to another group."""
        groups = [self.embedding_group, *self.layer_groups, self.head_group]
        return sum(a != b for a, b in zip(groups, groups[1:]))


def all_on(device: str, n_layers: int) -> DeviceMap:
    group = -1 if device == HOST else 0
    return DeviceMap((device,) * n_layers, (group,) * n_layers, device, group,
                     summary=f"plan: all {n_layers} layers and the output head on {device}")


def parse_layer_count(value, option: str = "n_gpu_layers") -> int | None:
    """'auto' or None -> None (layerplan chooses); a number -> that number (>= 0). The one parser
    of a layer count: n_gpu_layers (--gpu-layers of every command) and plan's n_cpu_moe."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise OptionError(option, f"{option} takes 'auto' or a number, not '{value}'.") from None
    if n < 0:
        raise OptionError(option, f"{option} takes 'auto' or a number from 0 up, not {n}.")
    return n


def plan_device_map(model, n_gpu_layers, *, n_ctx: int, n_parallel: int = 1, kv_type: str = DEFAULT_KV_TYPE,
                    machine=None, use_gpus: bool = True) -> DeviceMap:
    """Ask layerplan where each layer goes on this machine (or `machine`), and what each
    device's KV pool may take, as a DeviceMap, sized with the engine's KV layouts (kv_type: the
    engine's). model: a ModelProfile (the header the loader already read) or a .gguf path.
    use_gpus=False plans for the host alone (torch without CUDA)."""
    import dataclasses

    import layerplan
    from layerplan.kv_cache import LOCALRUN
    n = parse_layer_count(n_gpu_layers)
    profile = model if isinstance(model, layerplan.ModelProfile) else layerplan.profile_gguf(model)
    machine = machine or layerplan.probe_machine()
    if not use_gpus:
        machine = dataclasses.replace(machine, gpus=())
    try:
        plan = layerplan.plan(profile, machine, n_ctx=n_ctx, n_parallel=n_parallel,
                              kv_type=kv_type, n_gpu_layers=n, with_sweep=False, runtime=LOCALRUN)
    except ValueError as err:              # PlanError: e.g. layers pinned to a GPU that is not there
        raise UserError(str(err)) from None
    return device_map_from_plan(plan)


def device_map_from_plan(plan) -> DeviceMap:
    """layerplan's Plan -> DeviceMap: machine device i is 'cuda:i' for GPUs, the host 'cpu';
    each device that holds KV gets the plan's budget for it (Plan.kv_budget_bytes)."""
    p, devices = plan.placement, plan.machine.devices

    def name(i: int) -> str:
        d = devices[i]
        return HOST if d.kind != "gpu" else f"cuda:{d.index if d.index is not None else i}"

    def group(i: int) -> int:
        return -1 if devices[i].kind != "gpu" else i

    n_on_gpu = sum(devices[i].kind == "gpu" for i in p.layer_devices)
    head = name(p.head_device)
    where = (f"all {len(p.layer_devices)} layers and the output head on {HOST}" if n_on_gpu == 0 and head == HOST
             else f"{n_on_gpu}/{len(p.layer_devices)} layers on GPU, output head on {head}")
    summary = (f"plan: {where}, predicted decode {plan.predicted.decode_tok_s:.0f} tok/s"
               + ("" if plan.fits else " (does not fit: " + " ".join(plan.reasons[:1]) + ")"))
    kv_budget = tuple((name(i), b) for i, b in enumerate(plan.kv_budget_bytes()) if b > 0)
    return DeviceMap(tuple(name(i) for i in p.layer_devices), tuple(group(i) for i in p.layer_devices),
                     head, group(p.head_device), summary=summary, kv_budget=kv_budget)
