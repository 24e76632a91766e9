"""What torch itself charges for watching a module or a gradient on every step (issue 18's fixed-cost target).

    python bench/hook_floor.py

One process, one thread, no harness: 50 Linear(8, 8) + 50 Tanh (the fixed-cost model of
``bench/hundred_modules.py``), a forward and backward per step, timed bare and with the cheapest
hooks a detector could register. The difference is the floor below any design that watches module
outputs (forward hooks) or gradients (gradient hooks) on every step: an empty Python forward hook
sends each module call down torch's hooked path. Alternating repeats, the minimum of each kept.
"""

from __future__ import annotations

import timeit

import torch


def main() -> None:
    torch.set_num_threads(1)
    layers: list[torch.nn.Module] = []
    for _ in range(50):
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(4, 8)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    params = list(model.parameters())
    acc: dict[int, torch.Tensor] = {}

    def step() -> None:
        model(x).pow(2).mean().backward()

    def timed() -> float:
        return min(timeit.repeat(step, number=200, repeat=5)) / 200 * 1e6

    def empty_forward(m: torch.nn.Module, a: object, o: torch.Tensor) -> None:
        return None

    def summing_forward(m: torch.nn.Module, a: object, o: torch.Tensor) -> None:
        acc[id(m)] = o.detach().sum(dtype=torch.float32)

    def empty_grad(p: torch.Tensor) -> None:
        return None

    variants = {
        "bare": [],
        "an empty forward hook on each of 50 Linears": [(m.register_forward_hook, empty_forward) for m in linears],
        "a forward hook with one sum on each of 50 Linears": [(m.register_forward_hook, summing_forward)
                                                             for m in linears],
        "an empty gradient hook on each of 100 parameters": [(p.register_post_accumulate_grad_hook, empty_grad)
                                                             for p in params],
    }
    best: dict[str, float] = {}
    for _ in range(3):
        for name, hooks in variants.items():
            handles = [register(fn) for register, fn in hooks]
            best[name] = min(best.get(name, float("inf")), timed())
            for h in handles:
                h.remove()
    bare = best["bare"]
    for name, us in best.items():
        extra = "" if name == "bare" else f"  (+{us - bare:.0f} us a step)"
        print(f"{name}: {us:.0f} us a step{extra}")
    grads = [p.detach() for p in params]
    fe = min(timeit.repeat(lambda: torch._foreach_norm(grads, 2.0), number=1000, repeat=5)) / 1000 * 1e6
    print(f"one _foreach_norm over the 100 parameters: {fe:.0f} us")


if __name__ == "__main__":
    main()
