"""What one model pass costs: the floor under any exact AutoAttack engine.

    python benchmarks/model_passes.py                                   # the quickstart's model, CPU
    python benchmarks/model_passes.py --ckpt CKPT --rows 35 52 250 --device cuda

Every robust point costs standard Linf AutoAttack 900 APGD-T and 900 FAB-T forward-backward passes, 900 FAB-T
checking forwards and 5000 Square forwards, whichever engine runs them. This times one forward pass
(no_grad) and one forward pass plus the input's gradient (what the attacks take) on random images at the
model's resolution, for each ``--rows`` batch size: the model as given and the fast engine's stand-in for it
(:func:`~robust_lightning.attacks.stand_ins.attack_stand_in`: BatchNorm folded), each with the standard and
the channels_last input layout (the fast engine's default on the CPU). The last line printed is a JSON object
with the milliseconds.
"""

import argparse
import json
import time

import torch

from robust_lightning.attacks.stand_ins import attack_stand_in
from robust_lightning.training.lightning_module import ImageClassifier


def milliseconds(model, x: torch.Tensor, gradient: bool, repeats: int) -> float:
    def one_pass():
        if gradient:
            x_req = x.clone().requires_grad_(True)
            torch.autograd.grad(model(x_req).logsumexp(1).sum(), x_req)
        else:
            with torch.no_grad():
                model(x)

    for _ in range(3):  # warm-up: kernel selection, allocator
        one_pass()
    if x.is_cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        one_pass()
    if x.is_cuda:
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default="runs/quickstart/checkpoints/last.ckpt")
    parser.add_argument("--rows", type=int, nargs="+", default=[35, 52, 135, 250])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    module = ImageClassifier.load_from_checkpoint(args.ckpt, map_location="cpu", weights_only=True, init_from=None)
    model = module.model.to(args.device).eval().requires_grad_(False)
    size = module.hparams.image_size
    variants = {}
    for fold in (False, True):
        for layout in ("standard", "channels_last"):
            net, folded = attack_stand_in(model, fold, layout == "channels_last")
            if folded == fold:  # (a model without BatchNorm to fold has no folded variant)
                variants["folded" if fold else "as given", layout] = net
    figures = []
    for rows in args.rows:
        x = torch.rand(rows, 3, size, size, device=args.device)
        for (weights, layout), run in variants.items():
            forward = milliseconds(run, x, gradient=False, repeats=args.repeats)
            with_gradient = milliseconds(run, x, gradient=True, repeats=args.repeats)
            figures.append(
                {
                    "rows": rows,
                    "model": weights,
                    "layout": layout,
                    "forward_ms": round(forward, 2),
                    "forward_backward_ms": round(with_gradient, 2),
                }
            )
            print(
                f"{rows:>5} rows, {weights:>8}, {layout:>13}: forward {forward:7.2f} ms, forward + input "
                f"gradient {with_gradient:7.2f} ms",
                flush=True,
            )
    print(json.dumps({"ckpt": args.ckpt, "device": args.device, "image_size": size, "passes": figures}))


if __name__ == "__main__":
    main()
