"""Exact context parallelism: planning (``plan.py``) and the segment driver (``exact.py``)."""
from .exact import cp_forward, cp_problem_forward, splice_segments
from .plan import (CostModel, SegmentIndex, SegmentPlan, estimated_us, parse_cp, plan_for_problem, plan_segments,
                   segment_index_tensors, split_sequences)

__all__ = ["CostModel", "SegmentIndex", "SegmentPlan", "cp_forward", "cp_problem_forward", "estimated_us",
           "parse_cp", "plan_for_problem", "plan_segments", "segment_index_tensors", "splice_segments",
           "split_sequences"]
