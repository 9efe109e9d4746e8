"""Scheduling: the DAG of a decode step, SM assignment policies, serialization, the VM."""

from .assign import POLICIES, assign, simulate
from .dag import StepProgram, build_program, dependency_closure
from .verify import find_races
from .vm import InstructionVM, ScheduleError

__all__ = ["POLICIES", "assign", "simulate", "StepProgram", "build_program", "dependency_closure",
           "find_races", "InstructionVM", "ScheduleError"]
