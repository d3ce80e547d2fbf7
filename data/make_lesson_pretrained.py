"""Make the lesson model's warm start: its body after 600 fp32 steps on the shipped reviews.

    python data/make_lesson_pretrained.py                 # rewrites data/lesson_pretrained/
    python data/make_lesson_pretrained.py --shape lab     # rewrites data/lab_pretrained/
    python data/make_lesson_pretrained.py --out /tmp/w    # writes a copy elsewhere

From random weights the lesson model sits at loss ln 2 for about 100 steps before it learns,
longer than a lesson can run a precision a CPU has no units for. So the lessons fine-tune
this checkpoint instead, as one fine-tunes a hub model: the encoder is kept, the pooler and
the classification head are left out, and `mplab.models.lesson_model(pretrained=True)` (or
`mplab.train.train(model="lesson-pretrained")`) draws a fresh head from its seed. A run then
starts at loss ln 2 and falls within tens of steps. `--shape lab` does the same for lesson 7's
lab model (`mplab.diagnosis.lab.LAB_SHAPE`: hidden 64, one layer), which
`mplab.diagnosis.lab.lab_model()` loads.

The training is mplab.train's defaults (the torch path, fp32 on the CPU, AdamW lr 1e-3,
50 warm-up steps, batch 32, seed 0); the folder is what `save_pretrained` writes, plus the
lesson tokenizer, so any Hugging Face loader reads it. The weights depend on the installed
torch's fp32 kernels, to the last bits.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEFT_OUT = ("bert.pooler.", "classifier.")  # drawn afresh when loaded, as for a new task
STEPS = 600


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("lesson", "lab"), default="lesson")
    parser.add_argument("--out", type=Path, help="default: data/<shape>_pretrained")
    args = parser.parse_args(argv)
    out = args.out or HERE / f"{args.shape}_pretrained"

    from mplab import models
    from mplab.train import TrainWarning, train

    if args.shape == "lab":
        from mplab.diagnosis.lab import LAB_SHAPE
    model = models.lesson_model(**(LAB_SHAPE if args.shape == "lab" else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainWarning)
        result = train(model=model, precision="fp32", device="cpu", steps=STEPS,
                       eval_samples=None, progress=False)
    body = {k: v for k, v in model.state_dict().items() if not k.startswith(LEFT_OUT)}
    model.save_pretrained(out, state_dict=body)
    models.lesson_tokenizer().save_pretrained(out)
    print(f"{args.shape}: {STEPS} fp32 steps, final loss {result.final_loss:.4f}, test accuracy "
          f"{result.eval_accuracy:.3f}; wrote {out} without {', '.join(LEFT_OUT)}")


if __name__ == "__main__":
    main()
