"""Exact context parallelism: planning (``plan.py``), the forward's segment driver (``exact.py``) and the
backward's (``backward.py``)."""
from .backward import BackwardStages, cp_backward, splice_reverse
from .exact import cp_forward, cp_problem_forward, splice_segments
from .plan import (BackwardPlan, CostModel, SegmentIndex, SegmentPlan, backward_estimated_us,
                   backward_plan_for_problem, estimated_us, parse_cp, plan_backward, plan_for_problem, plan_segments,
                   segment_index_tensors, split_sequences)

__all__ = ["BackwardPlan", "BackwardStages", "CostModel", "backward_estimated_us", "backward_plan_for_problem",
           "plan_backward", "SegmentIndex", "SegmentPlan", "cp_backward", "cp_forward",
           "cp_problem_forward", "estimated_us", "parse_cp", "plan_for_problem", "plan_segments",
           "segment_index_tensors", "splice_reverse", "splice_segments", "split_sequences"]
