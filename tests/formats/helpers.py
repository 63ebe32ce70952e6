"""Logs of other tools, written the way the tools write them, with a loss spike at a known step."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

SPIKE_AT = 60


def losses(steps: int = 100, spike_at: int = SPIKE_AT) -> list[float]:
    """A slowly falling loss with a little wobble and a 50x spike at `spike_at`."""
    return [(3.0 - step / steps) * (1 + 0.01 * math.sin(step)) * (50.0 if step == spike_at else 1.0)
            for step in range(1, steps + 1)]


def megatron_line(iteration: int, train_iters: int, loss: float, when: datetime) -> str:
    """One line of Megatron-LM's training_log, built with the format strings of megatron/training/training.py."""
    log_string = f" [{when.strftime('%Y-%m-%d %H:%M:%S')}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, train_iters)
    log_string += ' consumed samples: {:12d} |'.format(iteration * 512)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(812.3)
    log_string += f' throughput per GPU (TFLOP/s/GPU): {401.2:.1f} |'
    log_string += ' learning rate: {:.6E} |'.format(3e-4)
    log_string += ' global batch size: {:5d} |'.format(512)
    log_string += ' {}: {:.6E} |'.format('lm loss', loss)
    log_string += f' loss scale: {1.0:.1f} |'
    log_string += f' grad norm: {0.41:.3f} |'
    log_string += ' number of skipped iterations: {:3d} |'.format(0)
    log_string += ' number of nan iterations: {:3d} |'.format(0)
    return log_string


def megatron_log(path, steps: int = 100, spike_at: int = SPIKE_AT) -> None:
    start = datetime(2026, 5, 1, 10, 0, 0)
    lines = ["using world size: 8, data-parallel size: 8", "> building GPT model ..."]
    lines += [megatron_line(i, steps, loss, start + timedelta(seconds=i))
              for i, loss in enumerate(losses(steps, spike_at), 1)]
    path.write_text("\n".join(lines) + "\n")


# torchtitan/tools/utils.py Color (the codes the metric line carries)
RED, GREEN, ORANGE, TURQUOISE, BLUE, CYAN, MAGENTA, RESET = (
    "\033[31m", "\033[32m", "\033[38;2;180;60;0m", "\033[38;2;54;234;195m", "\033[34m", "\033[36m", "\033[35m",
    "\033[39m")


def torchtitan_line(step: int, loss: float, when: datetime) -> str:
    """torchtitan/components/metrics.py MetricsProcessor.log's message through the `[titan]` logger format."""
    message = (f"{RED}step: {step:2}  "
               f"{GREEN}loss: {loss:8.5f}  "
               f"{ORANGE}grad_norm: {0.8123:7.4f}  "
               f"{TURQUOISE}memory: {31.25:5.2f}GiB"
               f"({39.47:.2f}%)  "
               f"{BLUE}tps: {round(12345.6):,}  "
               f"{CYAN}tflops: {1234.5:,.2f}  "
               f"{MAGENTA}mfu: {40.12:.2f}%{RESET}")
    return f"[titan] {when.strftime('%Y-%m-%d %H:%M:%S')},123 - root - INFO - {message}"


def torchtitan_log(path, steps: int = 100, spike_at: int = SPIKE_AT) -> None:
    start = datetime(2026, 5, 1, 10, 0, 0)
    lines = [f"[titan] {start.strftime('%Y-%m-%d %H:%M:%S')},001 - root - INFO - Building llama3 debugmodel"]
    lines += [torchtitan_line(i, loss, start + timedelta(seconds=i)) for i, loss in enumerate(losses(steps, spike_at), 1)]
    path.write_text("\n".join(lines) + "\n")
