"""Tensor parallelism inside the megakernel, simulated on the CPU: the program every rank runs (dag), the VM
that runs all ranks' queues with the exchanges between them (vm), and the race check across ranks and steps
(verify). The device code that runs it: megakernel.kernel.tensor_parallel and runtime.tensor_parallel."""

from .dag import (TPStepProgram, build_tp_program, counter_name, exchange_counter, is_exchange_counter,
                  lm_exchange_counter, tp_num_counters)
from .verify import find_tp_races, happens_before, wait_problems
from .vm import ORDERS, TPInstructionVM, TPVMDecoder, rank_tables, run_ranks, simulate_ranks

__all__ = ["TPStepProgram", "build_tp_program", "counter_name", "exchange_counter", "is_exchange_counter",
           "lm_exchange_counter", "tp_num_counters", "find_tp_races", "happens_before", "wait_problems", "ORDERS",
           "TPInstructionVM", "TPVMDecoder", "rank_tables", "run_ranks", "simulate_ranks"]
