"""Stack classes by the innermost frame (trainguard/decide/culprit.py, `stack_class`), on py-spy dumps as
py-spy 0.4 prints them for a Hugging Face GPT-2 wrapped in DDP under the HF Trainer (Python 3.11: qualified
function names, paths relative to sys.path, innermost frame first).

A rank sleeping in its own forward hook was classed "in a collective" because DDP's forward was
further down its stack, and the verdict said "no culprit: all ranks in the same collective (a network or
job-wide problem)" while py-spy showed the hook.
"""

from __future__ import annotations

from trainguard.decide import culprit
from trainguard.decide.culprit import RankEvidence, decide

HEADER = '''Process {pid}: /opt/venv/bin/python train_hf.py --model gpt2 --ddp
Python v3.11.9 (/usr/bin/python3.11)

'''
HF_TRAINER_BELOW = '''    Trainer.compute_loss (transformers/trainer.py:3801)
    Trainer.training_step (transformers/trainer.py:3745)
    Trainer._inner_training_loop (transformers/trainer.py:2560)
    Trainer.train (transformers/trainer.py:2245)
    main (train_hf.py:88)
    <module> (train_hf.py:92)
'''
SIDE_THREADS = '''Thread 4301 (idle): "Thread-1 (_pin_memory_loop)"
    Condition.wait (threading.py:331)
    Queue.get (queue.py:180)
    _pin_memory_loop (torch/utils/data/_utils/pin_memory.py:55)
    Thread.run (threading.py:1010)
    Thread._bootstrap_inner (threading.py:1073)
    Thread._bootstrap (threading.py:1030)
'''
# Rank 1 sleeps in a forward hook it registered on a GPT-2 block (a user's debugging hook, a slow
# metrics upload): DDP's forward, and its module wrappers, are below the hook.
IN_HOOK_UNDER_DDP = HEADER.format(pid=4243) + '''Thread 4243 (idle): "MainThread"
    main.<locals>.log_activation_stats (train_hf.py:41)
    Module._call_impl (torch/nn/modules/module.py:1805)
    Module._wrapped_call_impl (torch/nn/modules/module.py:1751)
    GPT2Model.forward (transformers/models/gpt2/modeling_gpt2.py:922)
    Module._call_impl (torch/nn/modules/module.py:1762)
    Module._wrapped_call_impl (torch/nn/modules/module.py:1751)
    GPT2LMHeadModel.forward (transformers/models/gpt2/modeling_gpt2.py:1062)
    Module._call_impl (torch/nn/modules/module.py:1762)
    Module._wrapped_call_impl (torch/nn/modules/module.py:1751)
    DistributedDataParallel._run_ddp_forward (torch/nn/parallel/distributed.py:1637)
    DistributedDataParallel.forward (torch/nn/parallel/distributed.py:1694)
    Module._call_impl (torch/nn/modules/module.py:1762)
    Module._wrapped_call_impl (torch/nn/modules/module.py:1751)
''' + HF_TRAINER_BELOW + SIDE_THREADS
# The same hook waiting on a lock or an event: the standard library's frames are innermost.
IN_HOOK_WAITING_ON_AN_EVENT = HEADER.format(pid=4244) + '''Thread 4244 (idle): "MainThread"
    Condition.wait (threading.py:331)
    Event.wait (threading.py:629)
    main.<locals>.log_activation_stats (train_hf.py:43)
    Module._call_impl (torch/nn/modules/module.py:1805)
    DistributedDataParallel._run_ddp_forward (torch/nn/parallel/distributed.py:1637)
    DistributedDataParallel.forward (torch/nn/parallel/distributed.py:1694)
''' + HF_TRAINER_BELOW
# Rank 0 went on to backward and waits there for DDP's gradient all-reduce with rank 1.
IN_DDP_BACKWARD = HEADER.format(pid=4242) + '''Thread 4242 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:824)
    backward (torch/autograd/__init__.py:347)
    Tensor.backward (torch/_tensor.py:648)
    Accelerator.backward (accelerate/accelerator.py:2473)
    Trainer.training_step (transformers/trainer.py:3787)
    Trainer._inner_training_loop (transformers/trainer.py:2560)
    Trainer.train (transformers/trainer.py:2245)
    main (train_hf.py:88)
    <module> (train_hf.py:92)
''' + SIDE_THREADS
# DDP's own forward broadcasting buffers (a collective it runs itself), with site-packages paths in full.
IN_DDP_BUFFER_BROADCAST = HEADER.format(pid=4245) + '''Thread 4245 (idle): "MainThread"
    DistributedDataParallel._distributed_broadcast_coalesced (/opt/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py:2050)
    DistributedDataParallel._sync_buffers (/opt/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py:2175)
    DistributedDataParallel._pre_forward (/opt/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py:1583)
    DistributedDataParallel.forward (/opt/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py:1691)
    Module._call_impl (/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1762)
''' + HF_TRAINER_BELOW
# A barrier in torch.distributed that waits through the standard library (the store's wait).
IN_BARRIER_THROUGH_THREADING = HEADER.format(pid=4246) + '''Thread 4246 (idle): "MainThread"
    Event.wait (threading.py:629)
    _store_based_barrier (torch/distributed/distributed_c10d.py:4561)
    barrier (torch/distributed/distributed_c10d.py:4620)
    main (train_hf.py:70)
'''


def test_a_rank_in_its_own_forward_hook_under_ddp_is_elsewhere_not_in_a_collective():
    assert culprit.stack_class(IN_HOOK_UNDER_DDP) == culprit.ELSEWHERE
    assert culprit.stack_class(IN_HOOK_WAITING_ON_AN_EVENT) == culprit.ELSEWHERE


def test_ranks_really_waiting_in_a_collective_still_are():
    assert culprit.stack_class(IN_DDP_BACKWARD) == culprit.IN_COLLECTIVE
    assert culprit.stack_class(IN_DDP_BUFFER_BROADCAST) == culprit.IN_COLLECTIVE
    assert culprit.stack_class(IN_BARRIER_THROUGH_THREADING) == culprit.IN_COLLECTIVE


def test_the_rank_in_its_hook_is_named_not_the_network():
    verdict = decide([RankEvidence(0, "n1", None, IN_DDP_BACKWARD), RankEvidence(1, "n2", None, IN_HOOK_UNDER_DDP)],
                     [])
    assert verdict.culprit == {"rank": 1, "node": "n2", "ranks": [1]}
    assert verdict.confidence == culprit.STACKS_ONLY
    assert not any("all ranks in the same collective" in reason for reason in verdict.reasons)
    assert "rank 1 (n2) stacks: elsewhere" in verdict.reasons


def test_local_variables_printed_under_a_frame_are_not_frames():
    """`py-spy dump --locals` prints each frame's arguments and locals, indented, below it."""
    with_locals = HEADER.format(pid=4247) + '''Thread 4247 (idle): "MainThread"
    Event.wait (threading.py:629)
        Arguments:
            self: <threading.Event at 0x7f3a2c1b2d10>
            timeout: None
    main.<locals>.log_activation_stats (train_hf.py:43)
        Arguments:
            module: <GPT2Block at 0x7f3a2c1b2e00>
    DistributedDataParallel.forward (torch/nn/parallel/distributed.py:1694)
'''
    assert culprit.stack_class(with_locals) == culprit.ELSEWHERE
    waiting = with_locals.replace("main.<locals>.log_activation_stats (train_hf.py:43)",
                                  "barrier (torch/distributed/distributed_c10d.py:4620)")
    assert culprit.stack_class(waiting) == culprit.IN_COLLECTIVE
