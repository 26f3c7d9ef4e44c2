"""Placement: which device holds each layer's weights and KV cache, and what each device then holds.

n_gpu_layers counts like llama.cpp's -ngl: the last N repeating layers go to the GPUs, and
N = n_layers + 1 puts the output head there too. The last layers (not the first) go to the
GPU because the input embedding is a table lookup that stays in host memory anyway, so the
activations cross to the GPU once per step, and the output head (the largest single matmul)
can then sit on the GPU beside the last layer. With several GPUs the offloaded layers are
split into contiguous runs in device order, each GPU filled as far as its budget allows.

MoE models add a second knob, llama.cpp's --n-cpu-moe N: the routed-expert tensors
(ffn_*_exps) of the first N layers stay in host memory, computed by the CPU, while the rest of
those layers (attention, router, shared experts, KV cache) sits on the layer's device. A token
reads only n_expert_used of n_expert experts, so experts in RAM cost far less per byte than
whole layers in RAM.
"""
from __future__ import annotations

from dataclasses import dataclass

from layerplan.buffers import BufferModel
from layerplan.devices import Device, Machine
from layerplan.kv_cache import layer_kv_bytes
from layerplan.model_profile import ModelProfile
from layerplan.settings import PlanSettings

HEAD = -1  # stands for the output head in the list of offloaded items


@dataclass(frozen=True)
class DeviceUsage:
    device: Device
    weights_bytes: int
    kv_bytes: int
    buffer_bytes: int
    n_layers: int            # repeating layers whose weights are here
    holds_head: bool
    budget_bytes: int        # free memory minus the margin

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.buffer_bytes

    @property
    def headroom_bytes(self) -> int:
        """Budget left after this plan (negative: over budget)."""
        return self.budget_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes


@dataclass(frozen=True)
class Placement:
    n_gpu_layers: int                 # llama.cpp's -ngl: the last N layers; n_layers + 1 adds the output head
    layer_devices: tuple[int, ...]    # per layer, an index into machine.devices
    kv_devices: tuple[int, ...]       # per layer, where its KV cache lives
    head_device: int
    usage: tuple[DeviceUsage, ...]    # in machine.devices order: GPUs, then the host
    n_cpu_moe: int = 0                # llama.cpp's --n-cpu-moe: experts of the first N layers in host memory
    expert_devices: tuple[int, ...] = ()  # per layer, where its routed experts live (empty: with the layer)

    def expert_device(self, layer: int) -> int:
        return self.expert_devices[layer] if self.expert_devices else self.layer_devices[layer]

    @property
    def fits(self) -> bool:
        return all(u.fits for u in self.usage)

    @property
    def gpu_split(self) -> tuple[int, ...]:
        """Offloaded items per GPU, the head counted as one (llama.cpp's -ts as counts)."""
        return tuple(u.n_layers + int(u.holds_head) for u in self.usage if u.device.kind == "gpu")

    @property
    def host(self) -> DeviceUsage:
        return self.usage[-1]


def budget_bytes(device: Device, settings: PlanSettings) -> int:
    return device.free_bytes - settings.margin_bytes


class LayerSizes:
    """Per-layer weight and KV bytes and the buffer sizes for one model at one setting."""

    def __init__(self, profile: ModelProfile, settings: PlanSettings):
        self.profile, self.settings = profile, settings
        self.weights = [layer.weight_bytes for layer in profile.layers]
        self.experts = [layer.expert_bytes for layer in profile.layers]
        self.kv = [layer_kv_bytes(layer, settings.kv, settings.n_ctx, settings.n_parallel)
                   for layer in profile.layers]
        self.buffers = BufferModel.of(profile, settings)


class _GPUFill:
    """Running totals of one GPU while items are added to it."""

    def __init__(self, device: Device, sizes: LayerSizes, n_cpu_moe: int = 0):
        self.device, self.sizes, self.n_cpu_moe = device, sizes, n_cpu_moe
        self.budget = budget_bytes(device, sizes.settings)
        self.layers: list[int] = []
        self.holds_head = False
        self.weights = self.kv = 0

    def _add(self, item: int, sign: int) -> None:
        if item == HEAD:
            self.holds_head = sign > 0
            self.weights += sign * self.sizes.profile.head_bytes
            return
        self.layers.append(item) if sign > 0 else self.layers.remove(item)
        experts_in_ram = self.sizes.experts[item] if item < self.n_cpu_moe else 0
        self.weights += sign * (self.sizes.weights[item] - experts_in_ram)
        if self.sizes.settings.kv_offload:
            self.kv += sign * self.sizes.kv[item]

    def total_with(self, item: int) -> int:
        self._add(item, +1)
        total = self.usage().total_bytes
        self._add(item, -1)
        return total

    def add(self, item: int) -> None:
        self._add(item, +1)

    def usage(self) -> DeviceUsage:
        buffers = self.sizes.buffers.device_bytes(is_gpu=True, n_layers=len(self.layers),
                                                  holds_head=self.holds_head, holds_kv=self.kv > 0)
        return DeviceUsage(self.device, self.weights, self.kv, buffers, len(self.layers), self.holds_head, self.budget)


def place(profile: ModelProfile, machine: Machine, settings: PlanSettings, n_gpu_layers: int,
          sizes: LayerSizes | None = None, n_cpu_moe: int = 0) -> Placement:
    """Place the last `n_gpu_layers` layers (llama.cpp's -ngl) on the machine's GPUs, keeping
    the routed experts of the first `n_cpu_moe` layers in host memory (llama.cpp's --n-cpu-moe)."""
    n = profile.n_layers
    assert 0 <= n_gpu_layers <= n + 1, f"n_gpu_layers {n_gpu_layers} outside 0..{n + 1}"
    assert 0 <= n_cpu_moe <= n, f"n_cpu_moe {n_cpu_moe} outside 0..{n}"
    assert machine.gpus or n_gpu_layers == 0, "layers offloaded to a machine without GPUs"
    sizes = sizes or LayerSizes(profile, settings)
    first_gpu_layer = n - min(n_gpu_layers, n)
    items = list(range(first_gpu_layer, n)) + ([HEAD] if n_gpu_layers == n + 1 else [])
    host_index = len(machine.gpus)

    # fill the GPUs in device order, each as far as its budget allows; the last one takes the rest
    fills = [_GPUFill(gpu, sizes, n_cpu_moe) for gpu in machine.gpus]
    g = 0
    for item in items:
        while g < len(fills) - 1 and fills[g].total_with(item) > fills[g].budget:
            g += 1
        fills[g].add(item)
    usage = [fill.usage() for fill in fills]

    layer_devices = [host_index] * n
    head_device = host_index
    for g, fill in enumerate(fills):
        for il in fill.layers:
            layer_devices[il] = g
        if fill.holds_head:
            head_device = g
    kv_devices = layer_devices if settings.kv_offload else [host_index] * n

    expert_devices = [host_index if il < n_cpu_moe else layer_devices[il] for il in range(n)]

    host_layers = [il for il in range(n) if layer_devices[il] == host_index]
    host_experts = [il for il in range(n) if expert_devices[il] == host_index and layer_devices[il] != host_index]
    host_kv = sum(sizes.kv[il] for il in range(n) if kv_devices[il] == host_index)
    head_on_host = head_device == host_index
    host_weights = (sum(sizes.weights[il] for il in host_layers) + sum(sizes.experts[il] for il in host_experts)
                    + profile.embedding_bytes + profile.other_bytes
                    + (profile.output_bytes if head_on_host else 0))  # a tied head shares token_embd in RAM
    host_buffers = sizes.buffers.device_bytes(is_gpu=False, n_layers=len(host_layers) + len(host_experts),
                                              holds_head=head_on_host, holds_kv=host_kv > 0)
    usage.append(DeviceUsage(machine.host, host_weights, host_kv, host_buffers, len(host_layers), head_on_host,
                             budget_bytes(machine.host, settings)))
    return Placement(n_gpu_layers, tuple(layer_devices), tuple(kv_devices), head_device, tuple(usage),
                     n_cpu_moe=n_cpu_moe, expert_devices=tuple(expert_devices) if n_cpu_moe else ())
