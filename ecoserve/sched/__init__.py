from ecoserve.sched.interface import Executor, ScheduledChunk, SchedulerOutput, StepResult
from ecoserve.sched.policy import POLICIES
from ecoserve.sched.scheduler import Scheduler

__all__ = ["Executor", "POLICIES", "ScheduledChunk", "Scheduler", "SchedulerOutput", "StepResult"]
