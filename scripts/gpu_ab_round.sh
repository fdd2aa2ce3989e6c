#!/usr/bin/env bash
# The open A/Bs and the sets the last changes move, on the GPU, in calls of under ten minutes each, on the GPU
# machine from the project root (OUTDIR best a local folder packed afterwards: the parts write many files):
#   source .device/setup.sh && scripts/gpu_ab_round.sh splice OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh bwd-set OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh starts OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh gates OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh rows OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh chains OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh canonical OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh auto-gain OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh cp-set OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh canon-sbs OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh forward-gain OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh segments OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh overlap OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh cluster OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh cluster-cp OUTDIR
# splice: the CP suite (every splice build, both directions, and the forward's chains build; gpu-cp.log), the
#   backward's own-plan tests with and without the backward started from the forward's segment starts
#   (backend.CP_REUSE_STARTS, whose chains now make their first M start + b in the splice; gpu-bwd-plan.log), a
#   training step's kernels on four few-head shapes both ways (step-kernels-reuse{0,1}.json), and the cp set's
#   fwd+bwd with the reuse on, flashgdn alone (cp-fwdbwd-reuse.json).
# bwd-set: the bwd set's fwd+bwd, flashgdn beside FlashQLA in one process, with both peak memories (bwd-set.json).
# starts: the transition pass's start states made in the kernel (backend.CP_STARTS_IN_KERNEL): its same-bits test
#   (gpu-starts.log), then a training step's kernels on four few-head shapes without and with it
#   (step-kernels-starts{0,1}.json), and the cp set's forward with it, flashgdn alone (cp-fwd-starts.json); then
#   the peak memory of the shapes whose forward splits after the forward's starts are released early
#   (StartsHandoff, notes v0.16l; memory-handoff.json, flashgdn alone).
# gates: the fused backward's P before K S and gating from registers (backward.FUSED_P_FIRST, FUSED_LEAN_GATES,
#   v0.16a's A/Bs, 10-12% off the kernel where its CTAs leave SMs idle) on the CP plans' shapes, where the backward
#   now runs it in one partial wave: their same-bits tests (gpu-gates.log), then a training step's kernels on eight
#   few-head shapes with both off and both on (step-kernels-gates{0,1}.json).
# rows: segment rows the host plan knows taken without a device gather (exact.HOST_ROWS, notes v0.16p): the CP and
#   backward GPU suites on it (gpu-rows.log), then a training step's kernels on the eight shapes of `gates` with
#   FLASHGDN_CP_HOST_ROWS=0 and 1 (step-kernels-rows{0,1}.json).
# chains: the backward's chains index by one kernel (backend.CP_CHAIN_INDEX, notes v0.16q): the CP and backward GPU
#   suites on it (gpu-chains.log), then a training step's kernels on the eight shapes with
#   FLASHGDN_HOPPER_CP_CHAIN_INDEX=0 and 1 (step-kernels-chains{0,1}.json).
# canonical: the canonical set's forward, flashgdn alone, all 171 shapes (canon.json), then its 82 shapes with
#   fewer CTAs than the GPU's SMs with cp="off" (canon-few-cp-off.json), for the 3% rule of context parallelism.
# auto-gain: the shapes where cp="auto" would split if it asked for a 1-10% predicted gain instead of 10%
#   (plan.AUTO_GAIN): the forward timed without CP and at each segment length (cp-choices-gain.json), and the two
#   bwd-set shapes among them forward and backward (cp-choices-gain-fwdbwd.json).
# cp-set: the cp set's fwd+bwd, flashgdn alone (cp-fwdbwd.json; CP_SET_BUDGET seconds of shapes, default 170).
# canon-sbs: the canonical set's 19 mixes on 16/32, flashgdn beside FlashQLA in one process (canon-1632.json).
# forward-gain: the forward's cp="auto" at a 3% predicted gain (plan.FORWARD_AUTO_GAIN 0.97) against 10% (0.9) on
#   the two bwd-set shapes where it changes the forward's plan, forward and fwd+bwd with peak memory, one process
#   each (gain-0.9.json, gain-0.97.json); then the bwd set's fwd+bwd, flashgdn alone (bwd.json).
# segments: the forward on segment lengths between the powers of two, where the model puts them 4-20% under its
#   pick among 16-256 (the transition items then fit one wave): eight few-CTA shapes at 24-256 chunks and without CP
#   (cp-choices-segments.json).
# overlap: the CP backward's walks from zero on a second stream (cp.backward.OVERLAP, notes v0.17b): the CP and backward
#   GPU suites with it (gpu-overlap.log), then fwd+bwd on 18 few-head shapes without and with it, flashgdn alone,
#   one process each (overlap0.json, overlap1.json).
# cluster: dq and dk summed inside the fused backward by a cluster of each group's CTAs (backward.FUSED_CLUSTER_SUM,
#   notes v0.18a): its same-bits tests (gpu-cluster.log; the rest is skipped unless they pass), then the bwd set's
#   fwd+bwd without and with it, flashgdn alone, one process each (bwd-cluster{0,1}.json).
# cluster-cp: the cp set's fwd+bwd without and with it (cp-cluster{0,1}.json), then a training step's live set at its
#   memory peak on 1/4 and 2/4 131072x1 with it (memory-peak.json).
# pairs: dq and dk added per pair of value heads into zeroed outputs by L2 reductions inside the fused backward
#   (backward.FUSED_PAIR_SUMS, notes v0.26a): its tests (gpu-pairs.log; the rest is skipped unless they pass), the
#   bwd set's fwd+bwd without and with it in one process (pairs-ab.json: the ratios, and whether the bits are the
#   same), then a training step's live set at its memory peak on the 16/32 eight-sequence mix and 32768x1, both
#   ways (memory-peak-pairs{0,1}.json).
# pairs-set: the bwd set's fwd+bwd with it, flashgdn alone (bwd-pairs.json, with peak memory).
# pairs-suite: the backward's, CP's and torch.compile's GPU suites with it on (gpu-suite-pairs.log).
# pairs-check: with its default (auto: groups of two), its tests and the one that compares a group of four with the
#   two-kernel backward (gpu-pairs-auto.log).
# zeros: the pair sums' outputs zeroed on their own stream beside the states pass (backward.PAIR_ZEROS_ASIDE, notes
#   v0.26b): the pair-sum, CP and CUDA-graph tests with it (gpu-zeros.log; the rest is skipped unless they pass),
#   the bwd set's fwd+bwd at 16/32 and 8/16 without and with it in one process (zeros-ab.json), then a training
#   step's kernels on 16/32 32768x1 both ways (step-kernels-zeros{0,1}.json).
# profile-fused: Nsight Compute on the fused backward alone (benchmarks/fused_backward_options.py's second launch, FUSED_SHAPE,
#   default 16/32:4096x8), once per option set of FUSED_SETS (default "default"; e.g. "default default+p_first"):
#   fused-ncu-SET.txt (speed of light, warp states, occupancy), fused-ncu-sass-SET.csv.xz (per-instruction stall
#   samples) and fused-stalls-SET.log (benchmarks/sass_stalls.py: the samples by role); with two sets, their A/B by
#   role (fused-stalls-ab.log). What notes v0.27b asks for before another reordering of the chunk step.
# p-given: the fused switches' same-bits GPU tests (FUSED_P_GIVEN among them) and, with it on, the fused CP backward's
#   and the CUDA-graph replays' tests, then FUSED_P_GIVEN on the bwd set
#   (switch_ab.py, fwdbwd); p-given-memory: its test at the defaults (16/32), the peak memory both ways and FlashQLA's,
#   notes v0.28b.
# Every step has a time limit; later steps run when one fails.
set -uo pipefail
# reuse-transitions: the backward on the forward's transition pairs where both run on the same segments
#   (backend.CP_REUSE_TRANSITIONS, notes v0.29a): its same-bits GPU tests and, with it on, the backward's tests
#   through autograd with CP and the CP tests of the backward (gpu-reuse-transitions*.log), a training step's kernels on five shapes whose plans agree
#   both ways (step-kernels-transitions{0,1}.json), and the bwd set's fwd+bwd both ways in one process
#   (switch_ab.py); reuse-transitions-cp: the bwd set's 4/8 and 2/4 shapes again (the first round's A/B was cut
#   before them), then the cp set's fwd+bwd both ways; reuse-transitions-memory: the peak memory of a training step
#   both ways on five shapes whose segments agree; lengths-after-reuse: fwd+bwd at cp = 16, 32 and 64 chunks (one length
#   for both passes, so the backward takes the forward's transitions) against cp="auto" on twelve shapes whose
#   forward and backward plans differ (cp-choices-lengths.json); forward-on-backward: the forward under autograd on
#   the backward's segments (backend.CP_FORWARD_ON_BACKWARD_SEGMENTS) both ways on the bwd and cp sets' 23 shapes
#   where the backward splits and the forward does not or on other lengths (rounding differs: --max-diff 1e-2), the
#   own-plan GPU tests with it on and off, and fwd+bwd at 16, 32 and 64 chunks against cp="auto" on the three where
#   only the backward's own plan splits.
# fold-mma: the fused backward's <dS', S> by the tensor cores (backward.FUSED_FOLD_MMA, notes v0.30a): its GPU tests
#   (gpu-fold-mma.log), then the kernel alone with and without it on five shapes (fold-mma-options.json);
#   fold-mma-sets: fwd+bwd both ways in one process on the bwd set's 4/8 and 8/16 shapes and the cp set's 2/4 and 8/16
#   (dg's rounding moves: --max-diff 1e-4; fold-mma-ab-{bwd,cp}.json).
# fold-gates: the same fold by the gate side beside p_given (from 32 value heads, notes v0.30b): the fold tests
#   (gpu-fold-gates.log), the kernel alone with and without it (fold-gates-options.json); fold-gates-sets:
#   fwd+bwd both ways in one process on the bwd set's 16/32 shapes (fold-gates-ab-bwd.json); fold-gates-fq: those
#   shapes beside FlashQLA (bwd-16x32.json).
# scan-dg, scan-dg-kernel, scan-dg-ab, scan-dg-check: the gate side's dg by warp shuffles (notes v0.31a; the option is
#   removed, 2988da6 has it and these rounds).
# l2-prefetch, l2-prefetch-ab, warp-colsums, warp-colsums-ab, row-mma, row-mma-ab, pending-tests, pending-kernels: the
#   fused backward's l2_prefetch, warp_colsums and row_mma (notes v0.32a, v0.32b, v0.33a; the options are removed,
#   2f029b7 has them and these rounds).
# lean-given: lean_gates beside p_given (notes v0.33b): the kernel alone at 16/32 and 8/32, default, default+lean_gates,
#   default, each in its own process (lean-given-options-{1,2,3}.json; the same bits).
# odd-blocks: stage 1 of a group of one at seven CTAs per SM (forward.KKT_ODD_GROUP_BLOCKS, notes v0.33c): its GPU
#   test (gpu-odd-blocks.log), then stage 1 alone against the five-per-SM build with and without A stored
#   (odd-blocks-{1,1A}.json); odd-blocks-ab: the forward and fwd+bwd both ways on the canonical set's full shapes at
#   32/32 and 16/16 (the same bits; odd-blocks-ab.json).
# profile-anchor-bwd: Nsight Compute on the fused backward of flashgdn and of FlashQLA (the anchor the backward trails,
#   0.80x its backward's speed on the bwd set) at PROFILE_SHAPE (default 16/32:4096x8), one process each
#   (benchmarks/training_step_once.py, the warm-up call's launch skipped): anchor-bwd-{flashgdn,flashqla}.txt (speed of
#   light, warp states, instruction statistics, occupancy), anchor-bwd-sass-*.csv.xz and anchor-bwd-stalls-*.log
#   (each role's stall samples; FlashQLA's roles by the registers its warpgroups set: 24 producer, 144 K side,
#   184 A side, 160 state).
# step-anchor: a training step's kernels, flashgdn's (cp auto) beside FlashQLA's, on the bwd set's 16/32 shapes (8192 and
#   32768 tokens in 1, 2 and 8 sequences) and its worst few-head ones (2/4 8192x1, 4/8 8 sequences of 32768 tokens),
#   each with the last step's launch order (step-anchor.json, step-anchor.log): which passes around the fused
#   backwards make the backward's gap, where the fused kernels alone are within 5% (notes "profile-anchor-bwd measured").
# negligible-m: the transition pass without a walk for an M below float32's range (backend.CP_NEGLIGIBLE_M, notes
#   v0.34a): its GPU tests (gpu-negligible-m.log), then both ways side by side in one process with the same-bits check:
#   the cp set's forward at 2/4, 4/8 and 8/16 (the head configs the shipped kernel cache holds;
#   negligible-m-cp-fwd.json), and fwd+bwd on the cp and bwd sets' 8/16 and the bwd set's 16/32 shapes
#   (negligible-m-fwdbwd.json).
# longest-first: the fused backward's rows of CTAs longest first (backward.FUSED_LONGEST_FIRST, notes v0.34b): its
#   same-bits GPU tests (gpu-longest-first.log), then fwd+bwd both ways side by side on the bwd set
#   (longest-first-ab.json; --max-diff 1e-2: on two 4/8 shapes the model then picks other segments, other rounding).
# late-b: the transition pass's b items from their first chunk that float32 can see (backend.CP_LATE_B beside
#   CP_NEGLIGIBLE_M, notes v0.35b): its GPU tests (gpu-late-b.log), then, with CP_NEGLIGIBLE_M on both ways, the cp set's
#   forward at 2/4, 4/8 and 8/16 (late-b-cp-fwd.json) and fwd+bwd at 8/16 (late-b-fwdbwd.json).
# walk-stop: the walks from zero stopped where the later tokens owe the start gradient nothing float32 holds
#   (backward.WALK_EARLY_STOP beside WALK_STARTS_ONLY, notes v0.35c): its GPU tests (gpu-walk-stop.log), then, with
#   WALK_STARTS_ONLY on both ways, fwd+bwd on the cp set's 2/4, 4/8 and 8/16 shapes (walk-stop-cp.json).
# walk-starts: CP's walks from zero without their per-chunk stores (backward.WALK_STARTS_ONLY, notes v0.35a): its
#   same-bits GPU tests (gpu-walk-starts.log), then fwd+bwd both ways side by side on the cp set's 2/4, 4/8 and 8/16
#   shapes (walk-starts-cp.json).
# walk-starts-bwd: the same on the bwd set (walk-starts-bwd.json), and one step's kernels at 8/16 131072x1 and 16/32
#   32768x1 with it off and on, one process each (walk-starts-steps-{0,1}.log).
# pending-tests: the GPU tests of the A/Bs built without a GPU to run them (v0.34a negligible-m with v0.35b late-b,
#   v0.34b longest-first, v0.35a walk-starts with v0.35c walk-stop) and chunk_grad's dg scan test, each in a pytest run of its own
#   (gpu-pending-*.log).
# pending-singles: each of the five alone (late-b with negligible-m on, walk-stop with walk-starts on), side by side in
#   one process per switch: walk-starts on the cp set's 2/4-8/16 fwd+bwd and on the bwd set, longest-first on the bwd
#   set (--max-diff 1e-2), negligible-m and late-b on the cp set's forward, walk-stop on the cp set's fwd+bwd
#   (single-*.json).
# pending-ab: those five switches set together, both ways side by side in one process: the cp set's 2/4, 4/8 and
#   8/16 shapes fwd and fwd+bwd (pending-ab-cp.json), and the bwd set's fwd+bwd (pending-ab-bwd.json; --max-diff
#   1e-2, as for longest-first alone). What each switch gave alone is for its own rounds.
# negligible-m-in-kernel: the same M items dropped by a bound stage 1 makes per chunk and the pass sums per segment
#   (backend.CP_NEGLIGIBLE_M_IN_KERNEL, notes v0.36a): its GPU tests (gpu-negligible-m-in-kernel.log), then both ways
#   side by side in one process on the cp set's forward at 1/4-8/16 (nmk-cp-fwd.json; 1/4, 2/8 and 4/16 compile on
#   the machine unless the shipped cache has them) and fwd+bwd at 2/4, 4/8 and 8/16 (nmk-cp-fwdbwd.json).
# m-zero-splice: the same with the splices leaving out the products of the M the pass stored as zero (notes v0.36b):
#   the GPU tests of the bounds and of the splice kernels (gpu-m-zero-splice.log), the forward's kernels per step
#   both ways on three shapes (mzs-steps-{0,1}.json), then the two A/Bs of negligible-m-in-kernel (mzs-cp-*.json).
# shorter-ties: a forward with no backward after it on the shortest segment length within 3% of the model's best
#   (backend.CP_SHORTER_TIES, notes v0.36c), both ways side by side: the cp set, the canonical set's 2/8 and 16/48
#   shapes and the bwd set's 4/8 ones, forward (shorter-ties-{cp,canonical,bwd}.json; six shapes move).
# cp-choices-m-zero: cp="auto"'s picks against every segment length now that vanishing M leave the pass and the
#   splice (notes v0.36b; the cost model counts every M): the cp set's single 32768- and 131072-token sequences at
#   every head configuration, forward (cp-choices-fwd.json), and four shapes' fwd+bwd (cp-choices-fwdbwd.json).
# cp-default: the GPU tests of context parallelism (the CP file, the backward's CP tests) after a change of its defaults
#   (gpu-cp-default.log).
# suite-rest: the GPU suite's files a default training step's change reaches (backward, compile, plan, reference: the
#   forward's and stage 1's kernels are unchanged since their last whole run, CP's ran with walk-starts on),
#   14 processes (gpu-suite-rest.log).
# cp-choices-regimes: the forward at 16, 32 and 64 chunks where the model's pick leaves half the SMs idle in the
#   output pass, or near it (1/4 and 2/4 65536 and 61440+4096, 2/8 32768, 4/16 8192), with the benchmark's gates
#   (cp-choices-regimes-fast.json: the long segments' M vanish) and with g x 0.1 (cp-choices-regimes-slow.json: none
#   vanishes), for a planner that is right under both (notes "Segment lengths under both gate regimes").
# shorter-wide (v0.36e, backend.CP_SHORTER_WIDE, notes "v0.36e"; measured with its first rule, 12% everywhere): the eleven
#   shapes that rule moved (and 2/8 32768, moved by
#   v0.36c already: no change) both ways with the benchmark's gates (shorter-wide-ab.json); then the seven moved shapes
#   not timed by cp-choices-regimes at every power-of-two length, gates x 0.1 then x 1 (shorter-wide-{slow,fast}.json).
# late-b-gate (v0.36h's defaults): the CP GPU test file (gpu-late-b-gate.log), then CP_LATE_B_IN_KERNEL both ways on
#   two shapes past CP_LATE_B_MIN_CHUNKS and two before it (late-b-gate-ab.json).
# walk-stop-kernel (v0.36j, backward.WALK_STOP_IN_KERNEL): its GPU tests and the walk's early-stop tests
#   (gpu-walk-stop-kernel.log),
#   then the switch both ways on the fwd+bwd of eight shapes whose backward segments reach WALK_STOP_MIN_CHUNKS and
#   two whose do not (walk-stop-kernel-ab.json; the latter the same plans and kernels both ways).
# walk-covers (v0.36k: the walks' covers by a kernel, the pass's loads unrolled; the counts' NaN-safe comparison):
#   the CP GPU test file with the defaults (gpu-walk-covers.log: the transition pass's count changed), then
#   WALK_STOP_IN_KERNEL both ways as in walk-stop-kernel (walk-covers-ab.json).
# ag-from-a (backward.FUSED_AG_FROM_A, notes v0.37a): its GPU test, a training step's peak both ways on 4/16 131072x1
#   and 2/8 65536x1, fwd+bwd both ways on ten shapes (ag-from-a-ab.json), the fused kernel's trace without and with
#   it at 4/16 (trace-ag-from-a{0,1}.json).
# ag-from-a-time: the same without the peaks (v0.37b changed the kernel alone).
# ag-from-a-peaks: a training step's peak with it on at the cp set's 27 Hqk = Hv / 4 shapes (memory-peak-cp-quarter.json).
# pairs-given: the pair sums in groups of four from 32 value heads (8/32, 16/64): GPU tests, fwd+bwd, peaks.
# pairs-default: the backward's GPU file with the pair sums in groups of two and four by default.
# preload: flashgdn.preload's GPU test, and the eager loop on fresh batches without and with it (notes "Kernels
#   loaded ahead of the first step"); then a host profile of a short eager step (4/16 8192x1) of both implementations.
# profile-stage1: Nsight Compute on stage 1's default build at 32/32 and 16/32 4096x8 (PROFILE_HEADS), its phases split
#   at its barriers by benchmarks/sass_phases.py: where the stage's time goes since diag16 and mma32 (notes "Stage 1
#   after FlashInfer's inverse").
# pairs-every-four: the backward's and the CP's GPU files with them in every group of four by default (v0.37d).
# pairs-quarter (notes v0.37c): backward.FUSED_PAIR_SUMS forced on, at the cp set's Hqk = Hv / 4 shapes (groups of four):
#   its GPU tests, fwd+bwd both ways (pairs-quarter-ab.json), the peaks with it on (memory-peak-pairs-quarter.json).
# walks-beside (v0.36l, backend.CP_WALKS_BESIDE_STATES): fwd+bwd both ways on the 8 of the 13 shapes whose backward
#   it splits (tests/test_cp.py's WALKS_BESIDE_STATES_MOVES) at 16/32 and 16/64, the heads whose training builds the
#   shipped kernel cache holds (walks-beside-ab.json).
# errors-cp, errors-forward: the CP GPU test file (gpu-suite-cp.log), the forward's files (gpu-suite-forward.log, as
#   suite-forward), each with every accuracy check's worst value over the run (NAME-errors.{md,json}).
# late-b-in-kernel (v0.36f, backend.CP_LATE_B_IN_KERNEL): its GPU tests (gpu-late-b-in-kernel.log), the cp set's
#   forward both ways (late-b-in-kernel-cp.json: the same bits, no --max-diff), fwd+bwd both ways at 2/8, 4/16 and
#   8/16 (late-b-in-kernel-cp-fwdbwd.json).
# suite-forward: the GPU suite's files that context parallelism's default change (v0.36b) reaches besides the CP file:
#   the forward, stage 1, the plan and the reference, 14 processes (gpu-suite-forward.log).
# cp-set-fq-fwd: the same for the forward (cp-set-fwd.json).
# cp-set-fq: the cp set's fwd+bwd, flashgdn beside FlashQLA in one process, with both peak memories (cp-set.json;
#   with CP_SET_PART=i/n that part of the set's head configs, cp-set-part{i}.json, within CP_SET_BUDGET seconds).
# fused-state-p-trace, fused-state-p-ab, fused-state-p-tests: P on the fused loop's state paths (forward.FUSED_STATE_P,
#   notes v0.41a): its trace beside the fused loop's at 32/32 and 16/32 (fused-state-p-trace-*.json); the A/B against
#   the fused loop (fused-state-p-ab.json) and against the default (fused-state-p-vs-default.json); its GPU tests
#   (gpu-fused-state-p.log).
# fused-state-p-options: its trace beside the same with v's tile swizzled and with the register inverse (notes v0.41b;
#   fused-state-p-options-*.json).
# profile-fused-state-p: Nsight Compute on the state_p build of the fused loop and on the rso loop at 32/32 4096x8, each
#   role's stalls and executed opcodes (profile-{fused_state_p,rso}-*), against benchmarks/sass_static.py's counts.
# fused-state-p-both: state_p with the register inverse and v's tile swizzled (forward.FUSED_REGISTER_INVERSE and
#   FUSED_SWIZZLED_V, notes v0.41c): its trace beside each option alone (fused-state-p-both-*.json), its trace build's
#   GPU test (gpu-fused-state-p-both.log), the op against the default (fused-state-p-both-vs-default.json) and against
#   state_p alone (fused-state-p-both-ab.json), and
#   profile-fused-state-p's Nsight Compute files for it (profile-fused_state_p_both-*).
# profile-flashinfer-fwd: Nsight Compute on FlashInfer's forward at 32/32 4096x8, its main kernel's roles read by
#   benchmarks/sass_static.py --ncu (fi-fwd-static.txt); FlashInfer on the PYTHONPATH as for scripts/bench_h200.sh.
# gk-tile, gk-tile-ab: the rso loop's gk_tile (notes v0.33d; the option is removed, 2f029b7 has it and these rounds).
# gates-24: the gate options between 16 and 32 value heads (notes v0.32c: without them ptxas serialises the build there):
#   its GPU test (gpu-gates-24.log), the kernel alone at 8/24 (a group of three) and 12/24 (pair sums) with the
#   operator's build against the one it made before, without p_first and lean_gates (gates-24-options-{3,2}.json).
# p-given-low: P given below 32 value heads now that the gate side folds beside it (notes v0.30c): the kernel alone
#   at 8/16, 4/16 and 4/8 (p-given-low-options.json), fwd+bwd both ways on the bwd and cp sets' 8/16 and 4/8 shapes
#   (p-given-low-ab.json).
usage="usage: scripts/gpu_ab_round.sh splice|bwd-set|starts|gates|rows|chains|canonical|auto-gain|cp-set|canon-sbs|forward-gain|segments|overlap|cluster|cluster-cp|pairs|pairs-set|pairs-suite|pairs-check|zeros|profile-fused|p-given|p-given-memory|reuse-transitions|reuse-transitions-cp|reuse-transitions-memory|lengths-after-reuse|forward-on-backward|fold-mma|fold-mma-sets|fold-gates|fold-gates-sets|fold-gates-fq|p-given-low|gates-24|lean-given|odd-blocks|odd-blocks-ab|profile-anchor-bwd|step-anchor|negligible-m|longest-first|walk-starts|walk-starts-bwd|pending-tests|pending-ab|pending-singles|late-b|walk-stop|suite-rest|cp-set-fq|negligible-m-in-kernel|m-zero-splice|cp-default|cp-set-fq-fwd|cp-choices-m-zero|shorter-ties|suite-forward|cp-choices-regimes|shorter-wide|late-b-in-kernel|late-b-gate|walk-stop-kernel|walk-covers|walks-beside|errors-cp|errors-forward|ag-from-a|ag-from-a-time|ag-from-a-peaks|pairs-quarter|pairs-default|pairs-given|pairs-every-four|profile-stage1|preload|fused-state-p-trace|fused-state-p-ab|fused-state-p-tests|fused-state-p-options|profile-fused-state-p|fused-state-p-both|profile-flashinfer-fwd OUTDIR"
part=${1:?$usage}
out=${2:?$usage}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
quiet() { grep -v "^  \|Warning\|^$\|INFO" "$1" | tail -"${2:-3}"; }
# a command under a time limit, its output and exit status in NAME.log: logged NAME SECONDS COMMAND...
logged() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "# exit status $?" >> "$out/$name.log"
}
# the GPU tests, quietly: gpu_tests NAME SECONDS WORKERS PYTEST_ARGS... (NAME.log; the worst value of each accuracy
# check, benchmarks/error_report.py: NAME-errors.md and .json, from the per-worker logs in errors-NAME/)
gpu_tests() {
  local name=$1 limit=$2 workers=$3; shift 3
  logged "$name" "$limit" env FLASHGDN_ERROR_LOG="$out/errors-$name" python3 -m pytest -m gpu -q -rfEx -n "$workers" "$@"
  quiet "$out/$name.log"
  # every accuracy check's worst value over the run (tests/helpers.py's log)
  python3 benchmarks/error_report.py "$out/errors-$name" --out "$out/$name-errors.json" > "$out/$name-errors.md" &&
    head -1 "$out/$name-errors.md"
}
# the fused loop's builds traced side by side (benchmarks/fused_trace.py) on 4096x8 at each of TRACE_HEADS (default
# 32/32 and 16/32): fused_traces NAME SECONDS BUILDS (NAME-32x32.json, ...)
fused_traces() {
  local name=$1 limit=$2 builds=$3 heads
  for heads in ${TRACE_HEADS:-32/32 16/32}; do
    logged "$name-${heads/\//x}" "$limit" python3 benchmarks/fused_trace.py --heads "$heads" \
      --seqlens 4096,4096,4096,4096,4096,4096,4096,4096 --builds "$builds" --out "$out/$name-${heads/\//x}.json"
    grep "^##" "$out/$name-${heads/\//x}.log"
  done
}
# Nsight Compute on one chunk loop of benchmarks/profile_stages.py at 32/32 4096x8 (profile_loop LOOP): each role's
# stall reasons and its executed instructions by opcode (profile-LOOP-{stalls,opcodes}.log), the static counts of each
# role's step beside the executed ones (profile-LOOP-static.txt, benchmarks/sass_static.py), the shared wavefronts, and
# the fused loops' gate warpgroup phase by phase (profile-LOOP-gate-phases.md, benchmarks/sass_phases.py --role 96)
profile_loop() {
  local loop=$1 kernel roles
  if [ "$loop" = rso ]; then kernel=chunk_forward_rso_; roles="160=state paths and output,32=producer"
  else kernel=chunk_forward_rs_; roles="192=state paths,96=gate,32=producer"; fi
  ncu_profile "profile-$loop" 200 "-k regex:$kernel --launch-skip 1 --launch-count 1" \
    python3 benchmarks/profile_stages.py --heads 32/32 --seqlens 4096,4096,4096,4096,4096,4096,4096,4096 --loops "$loop"
  grep -E "Duration|Executed Ipc A|Issue Slots Busy|L1/TEX Hit|Mem Busy|Max Bandwidth|DRAM Throughput|Compute \(SM\)" \
    "$out/profile-$loop.txt" | head -10
  python3 benchmarks/sass_stalls.py "$out/profile-$loop-sass.csv.xz" --roles "$roles" > "$out/profile-$loop-stalls.log" 2>&1
  # per 65536: 256 CTAs x 64 chunks x 4 warps, a warp's instructions a chunk (the state paths' 8 warps count twice)
  python3 benchmarks/sass_opcodes.py "$out/profile-$loop-sass.csv.xz" --roles "$roles" --per 65536 \
    > "$out/profile-$loop-opcodes.log" 2>&1
  python3 benchmarks/sass_static.py --ncu "$out/profile-$loop-sass.csv.xz" > "$out/profile-$loop-static.txt" 2>&1
  tail -6 "$out/profile-$loop-static.txt"
  python3 benchmarks/sass_wavefronts.py "$out/profile-$loop-sass.csv.xz" --top 12 > "$out/profile-$loop-wavefronts.md" 2>&1
  if [ "$loop" != rso ]; then  # the gate warpgroup's chain, phase by phase (between its warpgroup's barriers)
    python3 benchmarks/sass_phases.py "$out/profile-$loop-sass.csv.xz" --role 96 > "$out/profile-$loop-gate-phases.md" 2>&1
    cat "$out/profile-$loop-gate-phases.md"
  fi
  head -40 "$out/profile-$loop-stalls.log"
}
# Nsight Compute (the full set, sources imported) on the launches SELECTION picks (ncu's options, split at spaces) of
# a command: the run's log (NAME-run.log), the report's sections (NAME.txt) and its source page (NAME-sass.csv.xz):
# ncu_profile NAME SECONDS SELECTION COMMAND...
ncu_profile() {
  local name=$1 limit=$2 select=$3 ncu
  shift 3
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  # shellcheck disable=SC2086
  logged "$name-run" "$limit" "$ncu" --clock-control none $select --set full --import-source yes -f -o "/tmp/$name" "$@"
  tail -3 "$out/$name-run.log"
  "$ncu" -i "/tmp/$name.ncu-rep" --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section LaunchStats > "$out/$name.txt" 2>&1
  "$ncu" -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass 2>&1 | xz -9 > "$out/$name-sass.csv.xz"
}
# backend.CP_NEGLIGIBLE_M_IN_KERNEL both ways side by side: the cp set's forward, and fwd+bwd at 2/4, 4/8 and 8/16
# (PREFIX-cp-fwd.json, PREFIX-cp-fwdbwd.json): negligible_m_in_kernel_ab PREFIX
negligible_m_in_kernel_ab() {
  local prefix=$1
  logged "$prefix-cp-fwd" 180 python3 benchmarks/switch_ab.py \
    --switch flashgdn.kernels.hopper.backend:CP_NEGLIGIBLE_M_IN_KERNEL --set cp --modes fwd --rounds 2 \
    --out "$out/$prefix-cp-fwd.json"
  grep "geometric\|same bits" "$out/$prefix-cp-fwd.log"
  logged "$prefix-cp-fwdbwd" 200 python3 benchmarks/switch_ab.py \
    --switch flashgdn.kernels.hopper.backend:CP_NEGLIGIBLE_M_IN_KERNEL --set cp --only-heads 2/4,4/8,8/16 \
    --modes fwdbwd --rounds 2 --out "$out/$prefix-cp-fwdbwd.json"
  grep "geometric\|same bits" "$out/$prefix-cp-fwdbwd.log"
}
# a training step's peak under SETTING (VAR=VALUE) at the cp set's 27 Hqk = Hv / 4 shapes, the same step as the
# benchmark's fwd+bwd peak, which the cp-set records hold for both implementations (NAME.json): quarter_peaks NAME SETTING
quarter_peaks() {
  local name=$1 setting=$2 cases="" heads mix
  for heads in 1/4 2/8 4/16; do
    for mix in 8192 16384 32768 65536 131072 16384,16384 65536,65536 61440,4096 122880,8192; do
      cases="$cases --case $heads:$mix"
    done
  done
  logged "$name" 240 env "$setting" python3 benchmarks/memory_peak.py $cases --top 3 --out "$out/$name.json"
  grep "peak" "$out/$name.log" | cut -c1-100
}
# the fused backward alone, one option set a process in the order given (a build's time can depend on the build timed
# beside it, notes v0.30b): kernel_sets PREFIX "SHAPES" SET... (PREFIX-1.json, PREFIX-2.json, ...)
kernel_sets() {
  local prefix=$1 shapes=$2 i=0 opts; shift 2
  for opts in "$@"; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # the shapes are words
    logged "$prefix-$i" 110 python3 benchmarks/fused_backward_options.py $shapes --sets "$opts" --rounds 7 \
      --out "$out/$prefix-$i.json"
    grep -A1 "^[0-9]*/[0-9]*:" "$out/$prefix-$i.log" | grep -v "^--"
  done
}
FOUR_SHAPES="--shape 2/4:32768 --shape 1/4:131072 --shape 4/8:32768 --shape 16/32:32768"
EIGHT_SHAPES="$FOUR_SHAPES --shape 2/4:8192 --shape 4/8:8192 --shape 8/16:8192 --shape 16/32:8192"
# a training step's kernels on few-head shapes with switches set: step_kernels NAME SECONDS "SHAPES" VAR=VALUE...
# (NAME.json, NAME.log)
step_kernels() {
  local name=$1 limit=$2 shapes=$3; shift 3
  # shellcheck disable=SC2086  # the shapes are words
  logged "$name" "$limit" env "$@" python3 benchmarks/step_kernels.py --cp auto --sequence $shapes \
    --out "$out/$name.json"
  grep "kernels per step\|exit" "$out/$name.log"
}
if [ "$part" = splice ]; then
  gpu_tests gpu-cp 120 8 tests/test_gpu_hopper_cp.py
  gpu_tests gpu-bwd-plan 90 6 tests/test_gpu_hopper_backward.py -k own_plan
  for on in 0 1; do
    step_kernels step-kernels-reuse$on 60 "$FOUR_SHAPES" FLASHGDN_HOPPER_CP_REUSE_STARTS=$on
  done
  logged cp-fwdbwd-reuse 230 env FLASHGDN_HOPPER_CP_REUSE_STARTS=1 python3 -m flashgdn.bench --set cp \
    --impls flashgdn --modes fwdbwd --time-budget 200 --no-plots --out-dir "$out" --name cp-fwdbwd-reuse
  tail -2 "$out/cp-fwdbwd-reuse.log"
elif [ "$part" = bwd-set ]; then
  logged bwd-set 560 python3 -m flashgdn.bench --set bwd --impls flashgdn,flashqla --modes fwdbwd --time-budget 520 \
    --no-plots --out-dir "$out" --name bwd-set
  tail -3 "$out/bwd-set.log"
elif [ "$part" = starts ]; then
  gpu_tests gpu-starts 120 6 tests/test_gpu_hopper_cp.py -k "starts_made_in_the_kernel"
  for on in 0 1; do
    step_kernels step-kernels-starts$on 60 "$FOUR_SHAPES" FLASHGDN_HOPPER_CP_STARTS_IN_KERNEL=$on
  done
  logged cp-fwd-starts 170 env FLASHGDN_HOPPER_CP_STARTS_IN_KERNEL=1 python3 -m flashgdn.bench --set cp \
    --impls flashgdn --modes fwd --time-budget 140 --no-plots --out-dir "$out" --name cp-fwd-starts
  tail -2 "$out/cp-fwd-starts.log"
  # flashgdn alone (FlashQLA's peak on these shapes is in latest.json, parts/bwd-v016i-*.json; its compile for 2/4
  # alone takes ~150 s)
  logged memory-handoff 90 python3 -m flashgdn.bench --heads 16/32,2/4 --seqlens 8192,32768 --impls flashgdn \
    --modes fwdbwd --time-budget 70 --no-plots --out-dir "$out" --name memory-handoff
  tail -2 "$out/memory-handoff.log"
elif [ "$part" = gates ]; then
  gpu_tests gpu-gates 150 4 tests/test_gpu_hopper_backward.py -k fused_switches
  for on in 0 1; do
    step_kernels step-kernels-gates$on 150 "$EIGHT_SHAPES" FLASHGDN_HOPPER_FUSED_P_FIRST=$on \
      FLASHGDN_HOPPER_FUSED_LEAN_GATES=$on
  done
elif [ "$part" = rows ]; then
  gpu_tests gpu-rows 200 8 tests/test_gpu_hopper_cp.py tests/test_gpu_hopper_backward.py
  for on in 0 1; do
    step_kernels step-kernels-rows$on 150 "$EIGHT_SHAPES" FLASHGDN_CP_HOST_ROWS=$on
  done
elif [ "$part" = chains ]; then
  gpu_tests gpu-chains 200 8 tests/test_gpu_hopper_cp.py tests/test_gpu_hopper_backward.py
  for on in 0 1; do
    step_kernels step-kernels-chains$on 150 "$EIGHT_SHAPES" FLASHGDN_HOPPER_CP_CHAIN_INDEX=$on
  done
elif [ "$part" = overlap ]; then
  gpu_tests gpu-overlap 240 8 tests/test_gpu_hopper_cp.py tests/test_gpu_hopper_backward.py
  for on in 0 1; do
    logged overlap$on 130 env FLASHGDN_CP_BACKWARD_OVERLAP=$on python3 -m flashgdn.bench \
      --heads 1/4,2/4,2/8,4/8,4/16,8/16 --seqlens 8192,32768,131072 --impls flashgdn --modes fwdbwd \
      --time-budget 110 --no-plots --out-dir "$out" --name overlap$on
    tail -2 "$out/overlap$on.log"
  done
elif [ "$part" = cluster ]; then
  gpu_tests gpu-cluster 240 4 tests/test_gpu_hopper_backward.py tests/test_gpu_hopper_cp.py -k cluster_sum
  if grep -q " passed" "$out/gpu-cluster.log" && ! grep -qE "[0-9]+ (failed|error)" "$out/gpu-cluster.log"; then
    for on in 0 1; do
      logged bwd-cluster$on 110 env FLASHGDN_HOPPER_FUSED_CLUSTER_SUM=$on python3 -m flashgdn.bench --set bwd \
        --impls flashgdn --modes fwdbwd --time-budget 90 --no-plots --out-dir "$out" --name bwd-cluster$on
      tail -2 "$out/bwd-cluster$on.log"
    done
  fi
elif [ "$part" = pairs ]; then
  gpu_tests gpu-pairs 240 12 tests/test_gpu_hopper_backward.py -k pair_sums
  if grep -q " passed" "$out/gpu-pairs.log" && ! grep -qE "[0-9]+ (failed|error)" "$out/gpu-pairs.log"; then
    logged pairs-ab 330 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:FUSED_PAIR_SUMS \
      --set bwd --modes fwdbwd --rounds 2 --out "$out/pairs-ab.json"
    tail -45 "$out/pairs-ab.log"
    for on in 0 1; do
      logged memory-peak-pairs$on 90 env FLASHGDN_HOPPER_FUSED_PAIR_SUMS=$on python3 benchmarks/memory_peak.py \
        --case 16/32:2308,9176,8884,1687,7967,73,2598,75 --case 16/32:32768 --out "$out/memory-peak-pairs$on.json"
      tail -6 "$out/memory-peak-pairs$on.log"
    done
  fi
elif [ "$part" = pairs-set ]; then
  logged bwd-pairs 200 env FLASHGDN_HOPPER_FUSED_PAIR_SUMS=1 python3 -m flashgdn.bench --set bwd --impls flashgdn \
    --modes fwdbwd --time-budget 170 --no-plots --out-dir "$out" --name bwd-pairs
  tail -2 "$out/bwd-pairs.log"
elif [ "$part" = pairs-suite ]; then
  (export FLASHGDN_HOPPER_FUSED_PAIR_SUMS=1
   gpu_tests gpu-suite-pairs 560 12 tests/test_gpu_hopper_backward.py tests/test_gpu_hopper_cp.py tests/test_gpu_compile.py)
elif [ "$part" = pairs-check ]; then
  gpu_tests gpu-pairs-auto 240 12 tests/test_gpu_hopper_backward.py \
    -k "pair_sums or deterministic_and_near"
elif [ "$part" = zeros ]; then
  gpu_tests gpu-zeros 240 12 tests/test_gpu_hopper_backward.py tests/test_gpu_compile.py \
    -k "pair_sums or (fused_backward_with_context_parallelism and opts0) or replays"
  if grep -q " passed" "$out/gpu-zeros.log" && ! grep -qE "[0-9]+ (failed|error)" "$out/gpu-zeros.log"; then
    logged zeros-ab 150 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:PAIR_ZEROS_ASIDE \
      --set bwd --modes fwdbwd --rounds 2 --only-heads 16/32,8/16 --out "$out/zeros-ab.json"
    tail -20 "$out/zeros-ab.log"
    for on in 0 1; do
      logged step-kernels-zeros$on 90 env FLASHGDN_HOPPER_PAIR_ZEROS_ASIDE=$on python3 benchmarks/step_kernels.py \
        --cp auto --shape 16/32:32768 --out "$out/step-kernels-zeros$on.json"
      grep -v "^ *$" "$out/step-kernels-zeros$on.log" | tail -14
    done
  fi
elif [ "$part" = profile-fused ]; then
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  tags=()
  for set in ${FUSED_SETS:-default}; do
    tag=${set//[,+]/-}
    tags+=("$tag")
    logged fused-ncu-$tag-run 240 "$ncu" --clock-control none -k regex:fused_backward --launch-skip 1 \
      --launch-count 1 --set full --import-source yes -f -o "/tmp/fused-$tag" \
      python3 benchmarks/fused_backward_options.py --shape "${FUSED_SHAPE:-16/32:4096x8}" --sets "$set" --rounds 1 \
      --calls 1
    tail -3 "$out/fused-ncu-$tag-run.log"
    "$ncu" -i "/tmp/fused-$tag.ncu-rep" --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats \
      > "$out/fused-ncu-$tag.txt" 2>&1
    "$ncu" -i "/tmp/fused-$tag.ncu-rep" --page source --csv --print-source sass 2>&1 | xz -9 \
      > "$out/fused-ncu-sass-$tag.csv.xz"
    python3 benchmarks/sass_stalls.py "$out/fused-ncu-sass-$tag.csv.xz" > "$out/fused-stalls-$tag.log" 2>&1
    head -30 "$out/fused-stalls-$tag.log"
  done
  if [ ${#tags[@]} -eq 2 ]; then
    python3 benchmarks/sass_stalls.py "$out/fused-ncu-sass-${tags[0]}.csv.xz" "$out/fused-ncu-sass-${tags[1]}.csv.xz" \
      | sed -n '/^== A\/B/,$p' > "$out/fused-stalls-ab.log" 2>&1
    cat "$out/fused-stalls-ab.log"
  fi
elif [ "$part" = profile-anchor-bwd ]; then
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  shape=${PROFILE_SHAPE:-16/32:4096x8}
  for impl in flashgdn flashqla; do
    if [ $impl = flashgdn ]; then kernel=fused_backward_kernel; roles=""; else
      kernel=fused_chunk_gdr_bwd; roles="24=producer,144=K side,184=A side,160=state"; fi
    logged anchor-bwd-$impl-run 240 "$ncu" --clock-control none -k regex:$kernel --launch-skip 1 --launch-count 1 \
      --set full --import-source yes -f -o "/tmp/anchor-bwd-$impl" \
      python3 benchmarks/training_step_once.py --impl $impl --shape "$shape" --warmup 1 --calls 1
    tail -3 "$out/anchor-bwd-$impl-run.log"
    "$ncu" -i "/tmp/anchor-bwd-$impl.ncu-rep" --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section InstructionStats --section ComputeWorkloadAnalysis --section LaunchStats \
      > "$out/anchor-bwd-$impl.txt" 2>&1
    grep -E "Duration|Executed Ipc A|Issue Slots Busy|Registers Per|Block Size|Grid Size|Executed Instructions " \
      "$out/anchor-bwd-$impl.txt" | head -12
    "$ncu" -i "/tmp/anchor-bwd-$impl.ncu-rep" --page source --csv --print-source sass 2>&1 | xz -9 \
      > "$out/anchor-bwd-sass-$impl.csv.xz"
    python3 benchmarks/sass_stalls.py "$out/anchor-bwd-sass-$impl.csv.xz" ${roles:+--roles "$roles"} \
      > "$out/anchor-bwd-stalls-$impl.log" 2>&1
    head -24 "$out/anchor-bwd-stalls-$impl.log"
  done
elif [ "$part" = preload ]; then
  # flashgdn.preload: its GPU test, then the eager loop on fresh batches without and with it (separate processes:
  # kernels loaded stay loaded), each step's kernel loads counted
  gpu_tests gpu-preload 240 1 tests/test_gpu_preload.py
  tail -3 "$out/gpu-preload.log"
  for pre in ${PRELOAD_LOOPS:-0 1}; do
    logged training-loop-preload$pre 150 python3 benchmarks/training_loop.py --impl flashgdn --shape 16/32:32768/8 \
      --batches fresh --steps 20 --budget-s 20 $([ $pre = 1 ] && echo --preload) \
      --out "$out/training-loop-preload$pre.json"
    grep "^| \|exit\|Error" "$out/training-loop-preload$pre.log" | tail -4
  done
  # where a short eager step's host time goes (notes "The eager training loop measured": 3.5 ms against 0.56 of kernels)
  if [ -z "${PRELOAD_LOOPS:-}" ]; then  # (PRELOAD_LOOPS picks the loops and leaves this out)
    logged host-profile 150 python3 benchmarks/training_loop.py --shape 4/16:8192/1 --batches fixed --steps 5 \
      --budget-s 10 --host-profile "$out/host-profile.txt" --out "$out/host-profile-loop.json"
    grep "^| \|exit\|Error" "$out/host-profile-loop.log" | tail -3
    grep "^# \|function calls" "$out/host-profile.txt"
  fi
elif [ "$part" = registers16 ] || [ "$part" = quadrants ] || [ "$part" = registers8 ]; then
  # stage 1's v0.38 A/Bs (notes v0.38a-e), one round each: its GPU tests, every v0.38 build's phases beside the
  # default build's (alone and full), and the forward with the round's switches against the default on whole-wave
  # shapes. registers16: the 16x16 blocks by elimination in registers (forward.KKT_REGISTERS16, v0.38a), the 16 -> 32
  # merges from them (KKT_MERGE16_REGISTERS, v0.38b) and the 32 -> 64 one (KKT_MERGE32_REGISTERS, v0.38c); quadrants:
  # the 32 -> 64 merge a quadrant a warp (KKT_MERGE32_QUADRANTS, v0.38d) after v0.38a-b; registers8: the 16x16 blocks
  # from 8x8 ones (KKT_REGISTERS8, v0.38e) with v0.38b and d
  case $part in
    registers16) switches=KKT_REGISTERS16,KKT_MERGE16_REGISTERS,KKT_MERGE32_REGISTERS rounds=${R16_ROUNDS:-1} ;;
    quadrants) switches=KKT_REGISTERS16,KKT_MERGE16_REGISTERS,KKT_MERGE32_QUADRANTS rounds=2 ;;
    registers8) switches=KKT_REGISTERS16,KKT_REGISTERS8,KKT_MERGE16_REGISTERS,KKT_MERGE32_QUADRANTS rounds=2 ;;
  esac
  gpu_tests gpu-$part 300 8 tests/test_gpu_hopper_stage1.py -k "$part or trace_build"
  logged stage1-trace-$part 240 python3 benchmarks/stage1_trace.py --heads 32/32,16/32 --registers16 \
    --out "$out/stage1-trace-$part.json"
  grep "^##" "$out/stage1-trace-$part.log"
  logged $part-ab 150 python3 benchmarks/switch_ab.py \
    --switch "$(echo "$switches" | sed 's/KKT_/flashgdn.kernels.hopper.forward:KKT_/g')" \
    --heads 32/32,16/32 --seqlens 4096x8,8192x4 --modes fwd --rounds "$rounds" --out "$out/$part-ab.json"
  tail -6 "$out/$part-ab.log"
elif [ "$part" = fused-registers ]; then
  # the "fused" loop's inverse by stage 1's register pieces (forward.FUSED_REGISTER_INVERSE, notes v0.39a): the
  # forward's oracle tests on it, then the op with it against the fused loop's substitution, and against the default
  # (rso with stage 1 apart), on whole-wave shapes of groups of one and two
  FLASHGDN_TEST_CHUNK_LOOPS=fused_registers gpu_tests gpu-fused-registers 240 8 tests/test_gpu_hopper_forward.py
  FLASHGDN_HOPPER_CHUNK_LOOP=fused logged fused-registers-ab 100 python3 benchmarks/switch_ab.py \
    --switch flashgdn.kernels.hopper.forward:FUSED_REGISTER_INVERSE --heads 32/32,16/16,16/32 --seqlens 4096x8 \
    --modes fwd --rounds 2 --max-diff 1e-2 --out "$out/fused-registers-ab.json"
  tail -5 "$out/fused-registers-ab.log"
  fwd=flashgdn.kernels.hopper.forward
  logged fused-registers-vs-default 180 python3 benchmarks/switch_ab.py \
    --switch "$fwd:DEFAULT_CHUNK_LOOP=rso/fused,$fwd:FUSED_REGISTER_INVERSE" \
    --heads 32/32,16/16,16/32 --seqlens 4096x8,8192x4 --modes fwd --rounds 2 --max-diff 1e-2 \
    --out "$out/fused-registers-vs-default.json"
  tail -6 "$out/fused-registers-vs-default.log"
elif [ "$part" = fused-trace ]; then
  # where the fused loop's chunk goes (notes v0.39a measured): its trace builds' GPU test, the trace of both inverses
  # on whole-wave shapes of a group of one and of two, and the rso loop's trace on the same shapes beside them
  FLASHGDN_TEST_CHUNK_LOOPS=fused,fused_registers gpu_tests gpu-fused-trace 200 2 tests/test_gpu_hopper_forward.py \
    -k fused_trace
  s8=4096,4096,4096,4096,4096,4096,4096,4096
  for heads in ${TRACE_HEADS:-32/32 16/32}; do
    logged fused-trace-${heads/\//x} 150 python3 benchmarks/fused_trace.py --heads "$heads" --seqlens $s8 \
      --out "$out/fused-trace-${heads/\//x}.json"
    grep -v "^ \|^#" "$out/fused-trace-${heads/\//x}.log" | tail -3
    logged rso-trace-${heads/\//x} 150 python3 benchmarks/rso_trace.py --heads "$heads" --seqlens $s8 \
      --out "$out/rso-trace-${heads/\//x}.json"
    head -1 "$out/rso-trace-${heads/\//x}.log"
  done
elif [ "$part" = fused-state-p-trace ]; then
  # P on the fused loop's state paths (forward.FUSED_STATE_P, notes v0.41a): its trace beside the substitution build's
  # on whole waves of a group of one and of two
  fused_traces fused-state-p-trace 100 substitution,state_p
elif [ "$part" = fused-state-p-options ]; then
  # two options of it by the same trace (notes v0.41b): v's tile swizzled, the gate's inverse by the register pieces
  fused_traces fused-state-p-options 150 state_p,state_p_swizzled,state_p_registers
elif [ "$part" = profile-fused-state-p ]; then
  # Nsight Compute on the fused loop with P on its state paths and on the default rso loop (32/32 4096x8)
  profile_loop fused_state_p
  profile_loop rso
elif [ "$part" = fused-state-p-both ]; then
  # state_p with both of v0.41b's options (notes v0.41c), most telling first: its trace build's GPU test, the op
  # against the default on whole waves and against state_p alone, Nsight Compute on its loop, then its trace beside
  # each option alone
  FLASHGDN_TEST_CHUNK_LOOPS=fused_state_p_both gpu_tests gpu-fused-state-p-both 150 2 tests/test_gpu_hopper_forward.py \
    -k trace_build
  fwd=flashgdn.kernels.hopper.forward
  logged fused-state-p-both-vs-default 150 python3 benchmarks/switch_ab.py \
    --switch "$fwd:DEFAULT_CHUNK_LOOP=rso/fused,$fwd:FUSED_STATE_P,$fwd:FUSED_REGISTER_INVERSE,$fwd:FUSED_SWIZZLED_V" \
    --heads 32/32,16/16,16/32 --seqlens 4096x8,8192x4 --modes fwd --rounds 2 --max-diff 1e-2 \
    --out "$out/fused-state-p-both-vs-default.json"
  tail -8 "$out/fused-state-p-both-vs-default.log"
  # the two options against state_p alone, the op side by side (the trace script times each build once, in order,
  # five calls after one: an order effect there would not show)
  FLASHGDN_HOPPER_CHUNK_LOOP=fused FLASHGDN_HOPPER_FUSED_STATE_P=1 logged fused-state-p-both-ab 120 \
    python3 benchmarks/switch_ab.py --switch "$fwd:FUSED_REGISTER_INVERSE,$fwd:FUSED_SWIZZLED_V" \
    --heads 32/32,16/32 --seqlens 4096x8 --modes fwd --rounds 2 --max-diff 1e-2 --out "$out/fused-state-p-both-ab.json"
  tail -4 "$out/fused-state-p-both-ab.log"
  profile_loop fused_state_p_both
  fused_traces fused-state-p-both 150 state_p_registers_swizzled,state_p_registers,state_p_swizzled,state_p
elif [ "$part" = profile-flashinfer-fwd ]; then
  # Nsight Compute on FlashInfer's forward (PROFILE_SHAPE, 32/32 4096x8): every kernel of its call after the warm-up
  # (an NVTX range: how many it launches is not known here); the one that executes the most read by
  # benchmarks/sass_static.py --ncu, its roles by the registers FlashInfer's source gives them (two state warpgroups
  # at 192, the aux one at 104, load/store at 24). Needs FlashInfer and the TileLang stack on the PYTHONPATH, as
  # scripts/bench_h200.sh's FlashInfer runs have them (a shell that could not bring .device/ along)
  ncu_profile fi-fwd 300 "--nvtx --nvtx-include call/" \
    python3 benchmarks/training_step_once.py --impl flashinfer --shape "${PROFILE_SHAPE:-32/32:4096x8}" --mode fwd \
    --warmup 1 --calls 1 --nvtx
  "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" -i /tmp/fi-fwd.ncu-rep --print-summary per-kernel \
    > "$out/fi-fwd-summary.txt" 2>&1
  python3 benchmarks/sass_static.py --ncu "$out/fi-fwd-sass.csv.xz" --roles "192=state 1|state 2,104=aux,24=load" \
    > "$out/fi-fwd-static.txt" 2>&1
  grep -E "Duration|Executed Ipc A|Issue Slots Busy|Registers Per|Block Size|Grid Size" "$out/fi-fwd.txt" | head -12
  head -50 "$out/fi-fwd-static.txt"
elif [ "$part" = fused-state-p-ab ]; then
  # the op with it against the fused loop, and against the default (rso with stage 1 apart)
  fwd=flashgdn.kernels.hopper.forward
  FLASHGDN_HOPPER_CHUNK_LOOP=fused logged fused-state-p-ab 90 python3 benchmarks/switch_ab.py \
    --switch $fwd:FUSED_STATE_P --heads 32/32,16/16,16/32 --seqlens 4096x8 --modes fwd --rounds 2 --max-diff 1e-2 \
    --out "$out/fused-state-p-ab.json"
  tail -5 "$out/fused-state-p-ab.log"
  logged fused-state-p-vs-default 120 python3 benchmarks/switch_ab.py \
    --switch "$fwd:DEFAULT_CHUNK_LOOP=rso/fused,$fwd:FUSED_STATE_P" \
    --heads 32/32,16/16,16/32 --seqlens 4096x8,8192x4 --modes fwd --rounds 2 --max-diff 1e-2 \
    --out "$out/fused-state-p-vs-default.json"
  tail -6 "$out/fused-state-p-vs-default.log"
elif [ "$part" = fused-state-p-tests ]; then
  # the forward's oracle tests on it (its trace build's among them)
  FLASHGDN_TEST_CHUNK_LOOPS=fused_state_p gpu_tests gpu-fused-state-p 200 8 tests/test_gpu_hopper_forward.py
elif [ "$part" = stage1-trace ]; then
  # stage 1's phases by the SM's cycle counter, one CTA an SM and on a full GPU (notes "How long stage 1's phases
  # take a CTA alone"): the trace build's GPU test, then benchmarks/stage1_trace.py on a group of one and of two
  gpu_tests gpu-stage1-trace 240 2 tests/test_gpu_hopper_stage1.py -k trace_build
  logged stage1-trace 240 python3 benchmarks/stage1_trace.py --heads ${TRACE_HEADS:-32/32,16/32} \
    --out "$out/stage1-trace.json"
  grep -v '^ ' "$out/stage1-trace.log" | tail -40
elif [ "$part" = profile-stage1 ]; then
  # stage 1 (the forward's default build) under Nsight Compute on whole-wave shapes of a group of one and of two; its
  # phases split at its barriers (benchmarks/sass_phases.py)
  for heads in ${PROFILE_HEADS:-32/32 16/32}; do
    tag=${heads/\//x}
    ncu_profile stage1-$tag 200 "-k regex:kkt_inverse --launch-skip 1 --launch-count 1" \
      python3 benchmarks/profile_stages.py --heads "$heads" --seqlens 4096,4096,4096,4096,4096,4096,4096,4096 --loops rso
    grep -E "Duration|Executed Ipc A|Issue Slots Busy|Registers Per|Achieved Occupancy|L1/TEX Hit|Mem Busy|Max Bandwidth|DRAM Throughput|Compute \(SM\)" \
      "$out/stage1-$tag.txt" | head -14
    python3 benchmarks/sass_phases.py "$out/stage1-$tag-sass.csv.xz" > "$out/stage1-$tag-phases.md" 2>&1
    python3 benchmarks/sass_wavefronts.py "$out/stage1-$tag-sass.csv.xz" --top 12 > "$out/stage1-$tag-wavefronts.md" 2>&1
    cat "$out/stage1-$tag-phases.md"
  done
elif [ "$part" = negligible-m ]; then
  gpu_tests gpu-negligible-m 150 4 tests/test_gpu_hopper_cp.py -k negligible
  logged negligible-m-cp-fwd 150 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backend:CP_NEGLIGIBLE_M \
    --set cp --only-heads 2/4,4/8,8/16 --modes fwd --rounds 2 --out "$out/negligible-m-cp-fwd.json"
  grep "geometric\|same bits" "$out/negligible-m-cp-fwd.log"
  logged negligible-m-fwdbwd 220 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backend:CP_NEGLIGIBLE_M \
    --set cp,bwd --only-heads 8/16,16/32 --modes fwdbwd --rounds 2 --out "$out/negligible-m-fwdbwd.json"
  grep "geometric\|same bits" "$out/negligible-m-fwdbwd.log"
elif [ "$part" = longest-first ]; then
  gpu_tests gpu-longest-first 150 4 tests/test_gpu_hopper_backward.py -k "fused_switches and LONGEST"
  logged longest-first-ab 360 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:FUSED_LONGEST_FIRST \
    --set bwd --modes fwdbwd --rounds 2 --max-diff 1e-2 --out "$out/longest-first-ab.json"
  grep "geometric\|same bits" "$out/longest-first-ab.log"
elif [ "$part" = late-b ]; then
  gpu_tests gpu-late-b 150 4 tests/test_gpu_hopper_cp.py -k late_b
  (export FLASHGDN_HOPPER_CP_NEGLIGIBLE_M=1
   logged late-b-cp-fwd 180 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backend:CP_LATE_B \
     --set cp --only-heads 2/4,4/8,8/16 --modes fwd --rounds 2 --out "$out/late-b-cp-fwd.json"
   grep "geometric\|same bits" "$out/late-b-cp-fwd.log"
   logged late-b-fwdbwd 200 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backend:CP_LATE_B \
     --set cp --only-heads 8/16 --modes fwdbwd --rounds 2 --out "$out/late-b-fwdbwd.json"
   grep "geometric\|same bits" "$out/late-b-fwdbwd.log")
elif [ "$part" = walk-stop ]; then
  gpu_tests gpu-walk-stop 150 4 tests/test_gpu_hopper_cp.py -k "walks_from_zero_stopped or walks_stopped"
  (export FLASHGDN_HOPPER_WALK_STARTS_ONLY=1
   logged walk-stop-cp 240 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:WALK_EARLY_STOP \
     --set cp --only-heads 2/4,4/8,8/16 --modes fwdbwd --rounds 2 --out "$out/walk-stop-cp.json"
   grep "geometric\|same bits" "$out/walk-stop-cp.log")
elif [ "$part" = walk-starts ]; then
  gpu_tests gpu-walk-starts 150 4 tests/test_gpu_hopper_cp.py -k "walk_starts or walks_from_zero_without"
  logged walk-starts-cp 200 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:WALK_STARTS_ONLY \
    --set cp --only-heads 2/4,4/8,8/16 --modes fwdbwd --rounds 2 --out "$out/walk-starts-cp.json"
  grep "geometric\|same bits" "$out/walk-starts-cp.log"
elif [ "$part" = walk-starts-bwd ]; then
  logged walk-starts-bwd 300 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:WALK_STARTS_ONLY \
    --set bwd --modes fwdbwd --rounds 2 --out "$out/walk-starts-bwd.json"
  grep "geometric\|same bits" "$out/walk-starts-bwd.log"
  for on in 0 1; do
    logged walk-starts-steps-$on 90 env FLASHGDN_HOPPER_WALK_STARTS_ONLY=$on python3 benchmarks/step_kernels.py \
      --cp auto --sequence --shape 8/16:131072 --shape 16/32:32768
    grep "kernels per step\|state_grad_walk" "$out/walk-starts-steps-$on.log" | head -6
  done
elif [ "$part" = pending-tests ]; then
  gpu_tests gpu-pending-negligible-m 140 4 tests/test_gpu_hopper_cp.py -k "negligible or late_b or float32s_range"
  gpu_tests gpu-pending-walk-starts 130 4 tests/test_gpu_hopper_cp.py \
    -k "walk_starts or walks_from_zero_without or walks_from_zero_stopped or walks_stopped"
  gpu_tests gpu-pending-longest-first 90 4 tests/test_gpu_hopper_backward.py -k "fused_switches and LONGEST"
  gpu_tests gpu-pending-dg-scan 160 2 tests/test_gpu_hopper_backward.py -k dg_scan_matches
elif [ "$part" = pending-ab ]; then
  switches=flashgdn.kernels.hopper.backend:CP_NEGLIGIBLE_M,flashgdn.kernels.hopper.backend:CP_LATE_B
  switches=$switches,flashgdn.kernels.hopper.backward:FUSED_LONGEST_FIRST,flashgdn.kernels.hopper.backward:WALK_STARTS_ONLY
  switches=$switches,flashgdn.kernels.hopper.backward:WALK_EARLY_STOP
  logged pending-ab-cp 220 python3 benchmarks/switch_ab.py --switch "$switches" --set cp --only-heads 2/4,4/8,8/16 \
    --modes fwd,fwdbwd --rounds 2 --out "$out/pending-ab-cp.json"
  grep "geometric\|same bits" "$out/pending-ab-cp.log"
  logged pending-ab-bwd 330 python3 benchmarks/switch_ab.py --switch "$switches" --set bwd --modes fwdbwd --rounds 2 \
    --max-diff 1e-2 --out "$out/pending-ab-bwd.json"
  grep "geometric\|same bits\|max_rel" "$out/pending-ab-bwd.log"
elif [ "$part" = pending-singles ]; then
  bk=flashgdn.kernels.hopper.backward be=flashgdn.kernels.hopper.backend
  logged single-walk-starts-cp 90 python3 benchmarks/switch_ab.py --switch $bk:WALK_STARTS_ONLY --set cp \
    --only-heads 2/4,4/8,8/16 --modes fwdbwd --rounds 2 --out "$out/single-walk-starts-cp.json"
  grep "geometric\|same bits" "$out/single-walk-starts-cp.log"
  logged single-longest-first-bwd 80 python3 benchmarks/switch_ab.py --switch $bk:FUSED_LONGEST_FIRST --set bwd \
    --modes fwdbwd --rounds 2 --max-diff 1e-2 --out "$out/single-longest-first-bwd.json"
  grep "geometric\|same bits" "$out/single-longest-first-bwd.log"
  logged single-negligible-m-cp 60 python3 benchmarks/switch_ab.py --switch $be:CP_NEGLIGIBLE_M --set cp \
    --only-heads 2/4,4/8,8/16 --modes fwd --rounds 2 --out "$out/single-negligible-m-cp.json"
  grep "geometric\|same bits" "$out/single-negligible-m-cp.log"
  logged single-walk-starts-bwd 80 python3 benchmarks/switch_ab.py --switch $bk:WALK_STARTS_ONLY --set bwd \
    --modes fwdbwd --rounds 2 --out "$out/single-walk-starts-bwd.json"
  grep "geometric\|same bits" "$out/single-walk-starts-bwd.log"
  logged single-late-b-cp 60 env FLASHGDN_HOPPER_CP_NEGLIGIBLE_M=1 python3 benchmarks/switch_ab.py --switch $be:CP_LATE_B \
    --set cp --only-heads 2/4,4/8,8/16 --modes fwd --rounds 2 --out "$out/single-late-b-cp.json"
  grep "geometric\|same bits" "$out/single-late-b-cp.log"
  logged single-walk-stop-cp 90 env FLASHGDN_HOPPER_WALK_STARTS_ONLY=1 python3 benchmarks/switch_ab.py \
    --switch $bk:WALK_EARLY_STOP --set cp --only-heads 2/4,4/8,8/16 --modes fwdbwd --rounds 2 \
    --out "$out/single-walk-stop-cp.json"
  grep "geometric\|same bits" "$out/single-walk-stop-cp.log"
elif [ "$part" = step-anchor ]; then
  logged step-anchor 420 python3 benchmarks/step_kernels.py --impl flashgdn --impl flashqla --cp auto --sequence \
    --shape 16/32:8192 --shape 16/32:775+7417 --shape 16/32:949+465+545+137+799+3437+468+1392 --shape 16/32:32768 \
    --shape 16/32:22306+10462 --shape 16/32:2308+9176+8884+1687+7967+73+2598+75 --shape 2/4:8192 \
    --shape 4/8:2308+9176+8884+1687+7967+73+2598+75 --out "$out/step-anchor.json"
  grep "kernels per step\|exit" "$out/step-anchor.log"
elif [ "$part" = training-loop ]; then
  # an eager training loop, a new batch every step, beside FlashQLA (host syncs, launches and compiles in the time)
  logged training-loop 420 python3 benchmarks/training_loop.py --steps 12 --budget-s 20 --out "$out/training-loop.json"
  grep "^| \|exit\|Error" "$out/training-loop.log" | tail -16
elif [ "$part" = step-anchor-cp ]; then
  # a training step's kernels beside FlashQLA's on few-head shapes of the cp set and one full bwd-set shape (the
  # v0.36 breakdown of step-kernels-fq-fwdbwd, again at v0.37d and wider; notes "Where a training step's time goes")
  logged step-anchor-cp 420 python3 benchmarks/step_kernels.py --impl flashgdn --impl flashqla --cp auto --mode fwdbwd \
    --shape 2/8:8192 --shape 4/16:8192 --shape 2/4:32768 --shape 8/16:32768 --shape 4/16:131072 \
    --shape 16/32:4096x8 --out "$out/step-anchor-cp.json"
  grep "kernels per step\|exit" "$out/step-anchor-cp.log"
elif [ "$part" = p-given ]; then
  gpu_tests gpu-p-given 240 8 tests/test_gpu_hopper_backward.py -k fused_switches
  (export FLASHGDN_HOPPER_FUSED_P_GIVEN=1
   gpu_tests gpu-p-given-on 240 8 tests/test_gpu_hopper_backward.py tests/test_gpu_compile.py \
     -k "(fused_backward_with_context_parallelism and opts0) or replays")
  if grep -q " passed" "$out/gpu-p-given.log" && ! grep -qE "[0-9]+ (failed|error)" "$out/gpu-p-given.log"; then
    logged p-given-ab 420 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:FUSED_P_GIVEN \
      --set bwd --modes fwdbwd --rounds 2 --out "$out/p-given-ab.json"
    tail -45 "$out/p-given-ab.log"
  fi
elif [ "$part" = p-given-memory ]; then
  gpu_tests gpu-p-given-default 200 4 tests/test_gpu_hopper_backward.py -k "given_p_by_default"
  for on in 0 1; do
    logged memory-peak-p-given$on 120 env FLASHGDN_HOPPER_FUSED_P_GIVEN=$on python3 benchmarks/memory_peak.py \
      --case 2/4:8192 --case 16/32:2308,9176,8884,1687,7967,73,2598,75 --case 16/32:32768 \
      --out "$out/memory-peak-p-given$on.json"
    grep "peak" "$out/memory-peak-p-given$on.log"
  done
  # (FlashQLA compiles its kernels first: 120 s was not enough)
  logged memory-peak-flashqla 420 python3 benchmarks/memory_peak.py --impl flashqla --case 2/4:8192 \
    --case 16/32:2308,9176,8884,1687,7967,73,2598,75 --case 16/32:32768 --out "$out/memory-peak-flashqla.json"
  grep "peak" "$out/memory-peak-flashqla.log"
elif [ "$part" = reuse-transitions ]; then
  gpu_tests gpu-reuse-transitions 200 6 tests/test_gpu_hopper_backward.py -k "forwards_transitions"
  (export FLASHGDN_HOPPER_CP_REUSE_TRANSITIONS=1
   gpu_tests gpu-reuse-transitions-on 240 8 tests/test_gpu_hopper_backward.py tests/test_gpu_hopper_cp.py \
     -k "own_plan or op_gradients_through or fused_backward_with_context or sync_free or overlap_gives \
         or skipping_unread or starts_made_in")
  for on in 0 1; do
    step_kernels step-kernels-transitions$on 90 \
      "--shape 2/4:8192 --shape 4/8:8192 --shape 2/8:8192 --shape 8/16:32768 --shape 16/32:32768" \
      FLASHGDN_HOPPER_CP_REUSE_TRANSITIONS=$on
  done
  if grep -q " passed" "$out/gpu-reuse-transitions.log" \
      && ! grep -qE "[0-9]+ (failed|error)" "$out/gpu-reuse-transitions.log"; then
    logged transitions-ab 300 python3 benchmarks/switch_ab.py \
      --switch flashgdn.kernels.hopper.backend:CP_REUSE_TRANSITIONS --set bwd --modes fwdbwd --rounds 2 \
      --out "$out/transitions-ab.json"
    tail -45 "$out/transitions-ab.log"
  fi
elif [ "$part" = reuse-transitions-cp ]; then
  logged transitions-ab-few 150 python3 benchmarks/switch_ab.py \
    --switch flashgdn.kernels.hopper.backend:CP_REUSE_TRANSITIONS --set bwd --only-heads 4/8,2/4 --modes fwdbwd \
    --rounds 2 --out "$out/transitions-ab-few.json"
  tail -20 "$out/transitions-ab-few.log"
  logged transitions-ab-cp 400 python3 benchmarks/switch_ab.py \
    --switch flashgdn.kernels.hopper.backend:CP_REUSE_TRANSITIONS --set cp --modes fwdbwd --rounds 2 \
    --out "$out/transitions-ab-cp.json"
  tail -55 "$out/transitions-ab-cp.log"
elif [ "$part" = reuse-transitions-memory ]; then
  for on in 0 1; do
    logged memory-peak-transitions$on 150 env FLASHGDN_HOPPER_CP_REUSE_TRANSITIONS=$on python3 benchmarks/memory_peak.py \
      --case 16/32:32768 --case 8/16:32768 --case 2/4:8192 --case 4/16:131072 --case 2/8:65536,65536 \
      --out "$out/memory-peak-transitions$on.json"
    grep "peak" "$out/memory-peak-transitions$on.log"
  done
elif [ "$part" = lengths-after-reuse ]; then
  logged cp-choices-lengths 400 python3 benchmarks/cp_choices.py --fwdbwd --segments 16,32,64 \
    --out "$out/cp-choices-lengths.json" \
    --shape 2/4:32768 --shape 2/4:22306+10462 --shape 2/4:1047+7059+11918+12744 \
    --shape 2/4:2308+9176+8884+1687+7967+73+2598+75 --shape 4/8:32768 --shape 4/8:1047+7059+11918+12744 \
    --shape 8/16:8192 --shape 8/16:775+7417 --shape 8/16:4163+924+1801+1304 --shape 1/4:65536 --shape 2/8:16384 \
    --shape 4/16:8192
  tail -3 "$out/cp-choices-lengths.log"
elif [ "$part" = forward-on-backward ]; then
  # the 23 shapes of the bwd and cp sets where the backward's plan splits and the forward's does not split or
  # splits on other lengths (the switch moves nothing elsewhere)
  logged forward-on-backward-ab 320 python3 benchmarks/switch_ab.py \
    --switch flashgdn.kernels.hopper.backend:CP_FORWARD_ON_BACKWARD_SEGMENTS --modes fwdbwd --rounds 2 \
    --max-diff 1e-2 --out "$out/forward-on-backward-ab.json" \
    --shape 8/16:8192 --shape 8/16:775+7417 --shape 8/16:4163+924+1801+1304 --shape 4/8:32768 \
    --shape 4/8:1047+7059+11918+12744 --shape 2/4:32768 --shape 2/4:22306+10462 --shape 2/4:1047+7059+11918+12744 \
    --shape 2/4:2308+9176+8884+1687+7967+73+2598+75 --shape 1/4:32768 --shape 1/4:65536 --shape 1/4:16384x2 \
    --shape 1/4:61440+4096 --shape 2/4:65536 --shape 2/4:16384x2 --shape 2/4:61440+4096 --shape 2/8:16384 \
    --shape 2/8:32768 --shape 4/8:16384 --shape 4/16:8192 --shape 16/32:4163+924+1801+1304 \
    --shape 8/16:949+465+545+137+799+3437+468+1392 --shape 8/16:2308+9176+8884+1687+7967+73+2598+75
  tail -28 "$out/forward-on-backward-ab.log"
  gpu_tests gpu-forward-on-backward 200 8 tests/test_gpu_hopper_backward.py -k own_plan
  # where only the backward's own plan splits: both passes on one length against cp="auto" and cp="off"
  logged cp-choices-backward-only 150 python3 benchmarks/cp_choices.py --fwdbwd --segments 16,32,64 \
    --out "$out/cp-choices-backward-only.json" --shape 16/32:4163+924+1801+1304 \
    --shape 8/16:949+465+545+137+799+3437+468+1392 --shape 8/16:2308+9176+8884+1687+7967+73+2598+75
  tail -8 "$out/cp-choices-backward-only.log"
elif [ "$part" = fold-mma ]; then
  gpu_tests gpu-fold-mma 200 8 tests/test_gpu_hopper_backward.py -k fold_by_the_tensor_cores
  logged fold-mma-options 300 python3 benchmarks/fused_backward_options.py --shape 8/16:8192x8 --shape 4/8:32768 \
    --shape 2/8:32768 --shape 4/16:8192 --shape 2/4:8192 --sets default default+fold_mma --rounds 9 \
    --out "$out/fold-mma-options.json"
  tail -16 "$out/fold-mma-options.log"
elif [ "$part" = fold-mma-sets ]; then
  logged fold-mma-ab-bwd 280 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:FUSED_FOLD_MMA \
    --set bwd --only-heads 4/8,8/16 --modes fwdbwd --rounds 2 --max-diff 1e-4 --out "$out/fold-mma-ab-bwd.json"
  tail -30 "$out/fold-mma-ab-bwd.log"
  logged fold-mma-ab-cp 280 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:FUSED_FOLD_MMA \
    --set cp --only-heads 2/4,8/16 --modes fwdbwd --rounds 2 --max-diff 1e-4 --out "$out/fold-mma-ab-cp.json"
  tail -30 "$out/fold-mma-ab-cp.log"
elif [ "$part" = fold-gates ]; then
  gpu_tests gpu-fold-gates 240 8 tests/test_gpu_hopper_backward.py -k fold_by_the_tensor_cores
  logged fold-gates-options 200 env FLASHGDN_HOPPER_FUSED_FOLD_MMA=0 python3 benchmarks/fused_backward_options.py \
    --shape 16/32:4096x8 --shape 16/32:8192x4 --shape 32/64:4096x4 --shape 8/32:4096x8 \
    --sets default default+fold_mma --rounds 9 --out "$out/fold-gates-options.json"
  tail -13 "$out/fold-gates-options.log"
elif [ "$part" = fold-gates-sets ]; then
  logged fold-gates-ab-bwd 240 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:FUSED_FOLD_MMA \
    --set bwd --only-heads 16/32 --modes fwdbwd --rounds 2 --max-diff 1e-4 --out "$out/fold-gates-ab-bwd.json"
  tail -14 "$out/fold-gates-ab-bwd.log"
elif [ "$part" = fold-gates-fq ]; then
  logged bwd-16x32 560 python3 -m flashgdn.bench --heads 16/32 --seqlens 8192,775+7417,4163+924+1801+1304,\
949+465+545+137+799+3437+468+1392,32768,22306+10462,1047+7059+11918+12744,2308+9176+8884+1687+7967+73+2598+75 \
    --impls flashgdn,flashqla --modes fwdbwd --time-budget 380 --no-plots --out-dir "$out" --name bwd-16x32
  tail -14 "$out/bwd-16x32.log"
elif [ "$part" = p-given-low ]; then
  logged p-given-low-options 200 python3 benchmarks/fused_backward_options.py --shape 8/16:8192x8 --shape 4/16:8192 \
    --shape 4/8:32768 --sets default default+p_given --rounds 9 --out "$out/p-given-low-options.json"
  tail -10 "$out/p-given-low-options.log"
  logged p-given-low-ab 380 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:FUSED_P_GIVEN \
    --set bwd,cp --only-heads 8/16,4/8 --modes fwdbwd --rounds 2 --max-diff 1e-4 --out "$out/p-given-low-ab.json"
  tail -5 "$out/p-given-low-ab.log"
elif [ "$part" = gates-24 ]; then
  gpu_tests gpu-gates-24 200 4 tests/test_gpu_hopper_backward.py -k between_16_and_32
  logged gates-24-options-3 140 python3 benchmarks/fused_backward_options.py --shape 8/24:4096x8 --shape 8/24:32768 \
    --sets p_first,lean_gates,fold_mma fold_mma --rounds 7 --out "$out/gates-24-options-3.json"
  grep -A1 "^[0-9]*/[0-9]*:" "$out/gates-24-options-3.log" | grep -v "^--"
  logged gates-24-options-2 140 python3 benchmarks/fused_backward_options.py --shape 12/24:8192x4 --shape 12/24:32768 \
    --sets pair_sums,p_first,lean_gates,fold_mma pair_sums,fold_mma --rounds 7 --out "$out/gates-24-options-2.json"
  grep -A1 "^[0-9]*/[0-9]*:" "$out/gates-24-options-2.log" | grep -v "^--"
elif [ "$part" = lean-given ]; then
  kernel_sets lean-given-options "--shape 16/32:4096x8 --shape 16/32:8192x4 --shape 8/32:4096x8" \
    default default+lean_gates default
elif [ "$part" = odd-blocks ]; then
  gpu_tests gpu-odd-blocks 150 8 tests/test_gpu_hopper_stage1.py tests/test_kkt_options.py -k "odd_group or occupancy_setting"
  ones="32/32:4096x8,32/32:8192x4,16/16:4096x8,16/16:8192x4"
  logged odd-blocks-1 120 python3 benchmarks/kkt_options.py --shapes "$ones" --base diag16+mma32 \
    --options diag16+mma32,diag16+mma32+blocks_per_sm=7 --rounds 5 --out "$out/odd-blocks-1.json"
  logged odd-blocks-1A 120 python3 benchmarks/kkt_options.py --shapes "$ones" --base diag16+mma32 --store-inverse \
    --options diag16+mma32,diag16+mma32+blocks_per_sm=7 --rounds 5 --out "$out/odd-blocks-1A.json"
  for f in 1 1A; do grep "x[0-9]*:\|geometric\|exit" "$out/odd-blocks-$f.log"; done
elif [ "$part" = odd-blocks-ab ]; then
  logged odd-blocks-ab 540 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.forward:KKT_ODD_GROUP_BLOCKS \
    --set canonical --ctas full --only-heads 32/32,16/16 --modes fwd,fwdbwd --rounds 2 --out "$out/odd-blocks-ab.json"
  tail -4 "$out/odd-blocks-ab.log"
elif [ "$part" = cluster-cp ]; then
  for on in 0 1; do
    logged cp-cluster$on 120 env FLASHGDN_HOPPER_FUSED_CLUSTER_SUM=$on python3 -m flashgdn.bench --set cp \
      --impls flashgdn --modes fwdbwd --time-budget 100 --no-plots --out-dir "$out" --name cp-cluster$on
    tail -2 "$out/cp-cluster$on.log"
  done
  logged memory-peak 150 python3 benchmarks/memory_peak.py --case 1/4:131072 --case 2/4:131072 \
    --out "$out/memory-peak.json"
  tail -12 "$out/memory-peak.log"
elif [ "$part" = canonical ]; then
  logged canon 200 python3 -m flashgdn.bench --set canonical --impls flashgdn --modes fwd --time-budget 170 \
    --no-plots --out-dir "$out" --name canon
  tail -2 "$out/canon.log"
  logged canon-few-cp-off 120 python3 -m flashgdn.bench --set canonical --ctas few --cp off --impls flashgdn \
    --modes fwd --time-budget 100 --no-plots --out-dir "$out" --name canon-few-cp-off
  tail -2 "$out/canon-few-cp-off.log"
elif [ "$part" = auto-gain ]; then
  logged cp-choices-gain 180 python3 benchmarks/cp_choices.py --segments 32,64,128,256 \
    --out "$out/cp-choices-gain.json" \
    --shape 8/32:16384+16384 --shape 16/32:16384+16384 --shape 32/32:16384+16384 --shape 16/64:16384 \
    --shape 16/64:32768 --shape 8/32:4096 --shape 16/32:4096 --shape 16/48:4096 --shape 32/32:4096 \
    --shape 4/16:4096+4096 --shape 8/24:4096+4096 --shape 16/16:4096+4096 --shape 8/32:1024+7168 \
    --shape 16/32:1024+7168 --shape 32/32:1024+7168 --shape 16/48:1024+7168 --shape 16/48:28672+4096 \
    --shape 16/48:4096+28672
  tail -2 "$out/cp-choices-gain.log"
  logged cp-choices-gain-fwdbwd 80 python3 benchmarks/cp_choices.py --fwdbwd --segments 32,64 \
    --out "$out/cp-choices-gain-fwdbwd.json" \
    --shape 8/16:4163+924+1801+1304 --shape 8/16:2308+9176+8884+1687+7967+73+2598+75
  tail -2 "$out/cp-choices-gain-fwdbwd.log"
elif [ "$part" = negligible-m-in-kernel ]; then
  gpu_tests gpu-negligible-m-in-kernel 180 6 tests/test_gpu_hopper_cp.py -k "kernels_bounds or chunk_bounds"
  negligible_m_in_kernel_ab nmk
elif [ "$part" = m-zero-splice ]; then
  gpu_tests gpu-m-zero-splice 200 6 tests/test_gpu_hopper_cp.py \
    -k "kernels_bounds or chunk_bounds or flagged or splice_kernel or splice_chains or fused_cp_kernels"
  for on in 0 1; do
    logged "mzs-steps-$on" 90 env FLASHGDN_HOPPER_CP_NEGLIGIBLE_M_IN_KERNEL=$on python3 benchmarks/step_kernels.py \
      --cp auto --mode fwd --shape 1/4:32768 --shape 2/8:65536 --shape 1/4:131072 --steps 10 \
      --out "$out/mzs-steps-$on.json"
    grep "kernels per step\|splice\|exit" "$out/mzs-steps-$on.log"
  done
  negligible_m_in_kernel_ab mzs
elif [ "$part" = shorter-ties ]; then
  for set in cp:1/4,2/4,2/8,4/8,4/16,8/16 canonical:2/8,16/48 bwd:4/8; do
    logged "shorter-ties-${set%%:*}" 200 python3 benchmarks/switch_ab.py \
      --switch flashgdn.kernels.hopper.backend:CP_SHORTER_TIES --set "${set%%:*}" --only-heads "${set#*:}" \
      --modes fwd --rounds 3 --max-diff 8e-3 --out "$out/shorter-ties-${set%%:*}.json"
    grep "geometric\|same bits" "$out/shorter-ties-${set%%:*}.log"
  done
elif [ "$part" = cp-choices-m-zero ]; then
  shapes=""
  for h in 1/4 2/4 2/8 4/8 4/16 8/16; do shapes="$shapes --shape $h:32768 --shape $h:131072"; done
  # shellcheck disable=SC2086  # the shapes are words
  logged cp-choices-fwd 280 python3 benchmarks/cp_choices.py $shapes --segments 16,32,64,128,256 \
    --out "$out/cp-choices-fwd.json"
  tail -4 "$out/cp-choices-fwd.log"
  logged cp-choices-fwdbwd 280 python3 benchmarks/cp_choices.py --shape 2/8:32768 --shape 4/8:32768 \
    --shape 2/4:131072 --shape 8/16:131072 --segments 32,64,128 --fwdbwd --out "$out/cp-choices-fwdbwd.json"
  tail -4 "$out/cp-choices-fwdbwd.log"
elif [ "$part" = cp-default ]; then
  gpu_tests gpu-cp-default 540 14 tests/test_gpu_hopper_cp.py tests/test_gpu_hopper_backward.py \
    -k "cp or CP or split or segment"
elif [ "$part" = suite-rest ]; then
  gpu_tests gpu-suite-rest 500 14 tests/test_gpu_hopper_backward.py tests/test_gpu_compile.py \
    tests/test_gpu_hopper_plan.py tests/test_gpu_reference.py
elif [ "$part" = cp-choices-regimes ]; then
  for regime in fast:1 slow:0.1; do
    logged "cp-choices-regimes-${regime%%:*}" 150 python3 benchmarks/cp_choices.py --shape 1/4:65536 \
      --shape 2/4:65536 --shape 1/4:61440+4096 --shape 2/8:32768 --shape 4/16:8192 --segments 16,32,64 \
      --gate-scale "${regime#*:}" --out "$out/cp-choices-regimes-${regime%%:*}.json"
    tail -6 "$out/cp-choices-regimes-${regime%%:*}.log"
  done
elif [ "$part" = suite-forward ]; then
  gpu_tests gpu-suite-forward 330 14 tests/test_gpu_hopper_forward.py tests/test_gpu_hopper_stage1.py \
    tests/test_gpu_hopper_plan.py tests/test_gpu_reference.py
elif [ "$part" = shorter-wide ]; then
  moved="1/4:61440+4096 1/4:65536 2/4:61440+4096 2/4:65536 4/16:8192 4/16:61440+4096 4/16:122880+8192 8/16:8192"
  moved="$moved 8/16:61440+4096 8/16:122880+8192 16/16:8192 2/8:32768"
  shapes=""
  for s in $moved; do shapes="$shapes --shape $s"; done
  # shellcheck disable=SC2086  # the shapes are words
  logged shorter-wide-ab 150 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backend:CP_SHORTER_WIDE \
    $shapes --modes fwd --rounds 3 --max-diff 8e-3 --out "$out/shorter-wide-ab.json"
  grep "geometric\|same bits" "$out/shorter-wide-ab.log"
  for scale in slow:0.1 fast:1; do  # the regime the switch risks first
    logged "shorter-wide-${scale%%:*}" 120 python3 benchmarks/cp_choices.py --shape 2/4:61440+4096 --shape 4/16:61440+4096 \
      --shape 8/16:61440+4096 --shape 4/16:122880+8192 --shape 8/16:122880+8192 --shape 8/16:8192 --shape 16/16:8192 \
      --segments 16,32,64,128,256 --gate-scale "${scale#*:}" --out "$out/shorter-wide-${scale%%:*}.json"
    cut -c1-400 "$out/shorter-wide-${scale%%:*}.log"
  done
elif [ "$part" = late-b-gate ]; then
  # the GPU tests of CP with the defaults (late b in kernel from 128-chunk segments on), then the switch both ways on
  # two shapes past the gate and two before it (the latter: the same plans and kernels both ways)
  gpu_tests gpu-late-b-gate 300 8 tests/test_gpu_hopper_cp.py
  logged late-b-gate-ab 120 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backend:CP_LATE_B_IN_KERNEL \
    --shape 8/16:131072 --shape 2/8:131072 --shape 2/8:65536 --shape 1/4:65536 --modes fwd --rounds 3 \
    --out "$out/late-b-gate-ab.json"
  grep "geometric\|same bits\|on/off" "$out/late-b-gate-ab.log"
elif [ "$part" = walk-stop-kernel ]; then
  gpu_tests gpu-walk-stop-kernel 300 8 tests/test_gpu_hopper_cp.py -k "emits or emission or stopped_early or walk_starts"
  logged walk-stop-kernel-ab 420 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:WALK_STOP_IN_KERNEL \
    --shape 4/16:131072 --shape 8/16:131072 --shape 4/16:65536 --shape 8/16:65536 --shape 2/8:131072 \
    --shape 4/8:131072 --shape 8/16:122880+8192 --shape 4/16:65536x2 --shape 2/8:32768 --shape 4/16:8192 \
    --modes fwdbwd --rounds 2 --out "$out/walk-stop-kernel-ab.json"
  grep "geometric\|same bits\|on/off" "$out/walk-stop-kernel-ab.log"
elif [ "$part" = walk-covers ]; then
  gpu_tests gpu-walk-covers 300 8 tests/test_gpu_hopper_cp.py
  logged walk-covers-ab 420 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:WALK_STOP_IN_KERNEL \
    --shape 4/16:131072 --shape 8/16:131072 --shape 4/16:65536 --shape 8/16:65536 --shape 2/8:131072 \
    --shape 4/8:131072 --shape 8/16:122880+8192 --shape 4/16:65536x2 --shape 2/8:32768 --shape 4/16:8192 \
    --modes fwdbwd --rounds 2 --out "$out/walk-covers-ab.json"
  grep "geometric\|same bits\|on/off" "$out/walk-covers-ab.log"
elif [ "$part" = errors-cp ]; then
  gpu_tests gpu-suite-cp 300 8 tests/test_gpu_hopper_cp.py
elif [ "$part" = errors-forward ]; then
  gpu_tests gpu-suite-forward 330 14 tests/test_gpu_hopper_forward.py tests/test_gpu_hopper_stage1.py \
    tests/test_gpu_hopper_plan.py tests/test_gpu_reference.py
elif [ "$part" = walks-beside ]; then
  logged walks-beside-ab 420 python3 benchmarks/switch_ab.py \
    --switch flashgdn.kernels.hopper.backend:CP_WALKS_BESIDE_STATES \
    --shape 16/32:949+465+545+137+799+3437+468+1392 --shape 16/32:1047+7059+11918+12744 --shape 16/32:2048 \
    --shape 16/64:2048+6144 --shape 16/64:6144+2048 --shape 16/64:8192+24576 --shape 16/64:12288+4096 \
    --shape 16/64:24576+8192 \
    --modes fwdbwd --rounds 2 --max-diff 8e-3 --out "$out/walks-beside-ab.json"
  grep "geometric\|same bits\|on/off" "$out/walks-beside-ab.log"
elif [ "$part" = ag-from-a ] || [ "$part" = ag-from-a-time ]; then
  # backward.FUSED_AG_FROM_A: its GPU test (gpu-ag-from-a.log), a training step's peak on two Hqk = Hv / 4 shapes
  # both ways (memory-peak-ag-from-a{0,1}.json), then fwd+bwd both ways on the cp set's Hqk = Hv / 4 long shapes and
  # the bwd set's 16/32 and 16/64 (ag-from-a-ab.json; not the same bits, so within dq's bar)
  gpu_tests gpu-ag-from-a 300 8 tests/test_gpu_hopper_backward.py -k "ag_from_a"
  # ag-from-a-time: the same less the peaks (the host's part, which makes them, is unchanged since v0.37a measured them)
  for on in $([ "$part" = ag-from-a ] && echo 0 1); do
    logged memory-peak-ag-from-a$on 150 env FLASHGDN_HOPPER_FUSED_AG_FROM_A=$on python3 benchmarks/memory_peak.py \
      --case 4/16:131072 --case 2/8:65536 --out "$out/memory-peak-ag-from-a$on.json"
    tail -12 "$out/memory-peak-ag-from-a$on.log"
  done
  logged ag-from-a-ab 420 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:FUSED_AG_FROM_A \
    --shape 4/16:131072 --shape 4/16:65536 --shape 4/16:65536x2 --shape 4/16:122880+8192 --shape 2/8:131072 \
    --shape 1/4:131072 --shape 4/16:8192 --shape 16/32:949+465+545+137+799+3437+468+1392 --shape 16/32:32768 \
    --shape 16/64:8192+24576 --modes fwdbwd --rounds 2 --max-diff 8e-3 --out "$out/ag-from-a-ab.json"
  grep "geometric\|same bits\|on/off" "$out/ag-from-a-ab.log"
  # what the gating costs a chunk step: the trace build of 4/16's build without and with it (compiled here)
  for opts in p_first,lean_gates,fold_mma p_first,lean_gates,fold_mma,ag_from_a; do
    name=trace-ag-from-a$([ "${opts##*,}" = ag_from_a ] && echo 1 || echo 0)
    logged "$name" 150 python3 benchmarks/fused_backward_trace.py --heads 4/16 --seqlens 8192,8192 --options "$opts" \
      --out "$out/$name.json"
    tail -30 "$out/$name.log"
  done
elif [ "$part" = ag-from-a-peaks ]; then
  # a training step's peak with FUSED_AG_FROM_A on at the cp set's 27 Hqk = Hv / 4 shapes (memory-peak-cp-quarter.json)
  quarter_peaks memory-peak-cp-quarter FLASHGDN_HOPPER_FUSED_AG_FROM_A=1
elif [ "$part" = pairs-given ]; then
  # the pair sums in groups of four from 32 value heads, beside a given P (notes "Waiting for a GPU (after v0.37c
  # measured)"): the pair-sum GPU tests (gpu-pairs-given.log), fwd+bwd both ways at 8/32 and 16/64
  # (pairs-given-ab.json; off is "auto", no pair sums there), the peaks both ways
  # (memory-peak-pairs-given-{auto,1}.json)
  gpu_tests gpu-pairs-given 240 8 tests/test_gpu_hopper_backward.py -k "test_fused_backward_pair_sums"
  logged pairs-given-ab 360 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:FUSED_PAIR_SUMS \
    --heads 8/32,16/64 --seqlens 32768,28672+4096,8192+24576,8192x4,4096x8,1024x8 --modes fwdbwd --rounds 2 \
    --max-diff 8e-3 --out "$out/pairs-given-ab.json"
  grep "geometric\|same bits" "$out/pairs-given-ab.log"
  for setting in auto 1; do
    logged "memory-peak-pairs-given-$setting" 120 env FLASHGDN_HOPPER_FUSED_PAIR_SUMS=$setting \
      python3 benchmarks/memory_peak.py --case 8/32:32768 --case 8/32:28672,4096 --case 16/64:32768 \
      --case 16/64:8192,24576 --top 3 --out "$out/memory-peak-pairs-given-$setting.json"
    grep "peak" "$out/memory-peak-pairs-given-$setting.log" | cut -c1-100
  done
elif [ "$part" = pairs-every-four ]; then
  # the backward's and the CP's GPU files with the pair sums taken by "auto" in every group of four (notes v0.37d
  # measured): gpu-pairs-every-four.log, gpu-suite-cp-pairs-every-four.log
  gpu_tests gpu-pairs-every-four 300 14 tests/test_gpu_hopper_backward.py
  gpu_tests gpu-suite-cp-pairs-every-four 200 8 tests/test_gpu_hopper_cp.py
elif [ "$part" = pairs-default ]; then
  # the backward's GPU file with the pair sums taken by "auto" in groups of four as well (notes v0.37c measured)
  gpu_tests gpu-pairs-default 420 14 tests/test_gpu_hopper_backward.py
elif [ "$part" = pairs-quarter ]; then
  # backward.FUSED_PAIR_SUMS forced on at groups of four (notes v0.37c): its GPU tests (gpu-pairs-quarter.log), fwd+bwd
  # both ways on the cp set's 27 Hqk = Hv / 4 shapes (pairs-quarter-ab.json: off is "auto" there, no pair sums in
  # groups of four), a training step's peak with it on at the same shapes (memory-peak-pairs-quarter.json)
  gpu_tests gpu-pairs-quarter 240 8 tests/test_gpu_hopper_backward.py -k "test_fused_backward_pair_sums"
  logged pairs-quarter-ab 300 python3 benchmarks/switch_ab.py --switch flashgdn.kernels.hopper.backward:FUSED_PAIR_SUMS \
    --set cp --only-heads 1/4,2/8,4/16 --modes fwdbwd --rounds 2 --max-diff 8e-3 --out "$out/pairs-quarter-ab.json"
  grep "geometric\|same bits" "$out/pairs-quarter-ab.log"
  quarter_peaks memory-peak-pairs-quarter FLASHGDN_HOPPER_FUSED_PAIR_SUMS=1
elif [ "$part" = late-b-in-kernel ]; then
  gpu_tests gpu-late-b-in-kernel 240 8 tests/test_gpu_hopper_cp.py -k "chunk_injects or late_b_in_kernel"
  logged late-b-in-kernel-cp 240 python3 benchmarks/switch_ab.py \
    --switch flashgdn.kernels.hopper.backend:CP_LATE_B_IN_KERNEL --set cp --modes fwd --rounds 3 \
    --out "$out/late-b-in-kernel-cp.json"
  grep "geometric\|same bits" "$out/late-b-in-kernel-cp.log"
  logged late-b-in-kernel-cp-fwdbwd 200 python3 benchmarks/switch_ab.py \
    --switch flashgdn.kernels.hopper.backend:CP_LATE_B_IN_KERNEL --set cp --only-heads 2/8,4/16,8/16 --modes fwdbwd \
    --rounds 2 --out "$out/late-b-in-kernel-cp-fwdbwd.json"
  grep "geometric\|same bits" "$out/late-b-in-kernel-cp-fwdbwd.log"
elif [ "$part" = cp-set-fq ]; then
  if [ -n "${CP_SET_PART:-}" ]; then  # i/n: that part of the set (the bench's --part), cp-set-part{i}.json
    budget=${CP_SET_BUDGET:-480}  # seconds of shapes; the limit is 50 more
    logged "cp-set-part${CP_SET_PART%/*}" $((budget + 50)) python3 -m flashgdn.bench --set cp \
      --impls flashgdn,flashqla --modes fwdbwd --part "$CP_SET_PART" --time-budget "$budget" --no-plots --out-dir "$out" \
      --name "cp-set-part${CP_SET_PART%/*}"
    tail -3 "$out/cp-set-part${CP_SET_PART%/*}.log"
  else
    logged cp-set 530 python3 -m flashgdn.bench --set cp --impls flashgdn,flashqla --modes fwdbwd --time-budget 480 \
      --no-plots --out-dir "$out" --name cp-set
    tail -3 "$out/cp-set.log"
  fi
elif [ "$part" = cp-set-fq-fwd ]; then
  logged cp-set-fwd 530 python3 -m flashgdn.bench --set cp --impls flashgdn,flashqla --modes fwd --time-budget 450 \
    --no-plots --out-dir "$out" --name cp-set-fwd
  tail -3 "$out/cp-set-fwd.log"
elif [ "$part" = cp-set ]; then
  budget=${CP_SET_BUDGET:-170}  # seconds of shapes; the limit is 30 more
  logged cp-fwdbwd $((budget + 30)) python3 -m flashgdn.bench --set cp --impls flashgdn --modes fwdbwd \
    --time-budget "$budget" --no-plots --out-dir "$out" --name cp-fwdbwd
  tail -2 "$out/cp-fwdbwd.log"
elif [ "$part" = canon-sbs ]; then
  logged canon-1632 130 python3 -m flashgdn.bench --heads 16/32 \
    --seqlens 32768,16384,8192,4096,2048,28672+4096,24576+8192,\
16384x2,8192+24576,4096+28672,12288+4096,6144+2048,4096x2,2048+6144,1024+7168,8192x4,4096x8,2048x4,1024x8 \
    --impls flashgdn,flashqla --modes fwd --time-budget 100 --no-plots --out-dir "$out" --name canon-1632
  tail -2 "$out/canon-1632.log"
elif [ "$part" = forward-gain ]; then
  for gain in 0.9 0.97; do
    logged gain-$gain 100 env FLASHGDN_CP_FORWARD_AUTO_GAIN=$gain python3 -m flashgdn.bench --heads 8/16 \
      --seqlens 4163+924+1801+1304,2308+9176+8884+1687+7967+73+2598+75 --impls flashgdn --modes fwd,fwdbwd \
      --time-budget 80 --no-plots --out-dir "$out" --name gain-$gain
    tail -2 "$out/gain-$gain.log"
  done
  logged bwd 160 python3 -m flashgdn.bench --set bwd --impls flashgdn --modes fwdbwd --time-budget 130 --no-plots \
    --out-dir "$out" --name bwd
  tail -2 "$out/bwd.log"
elif [ "$part" = segments ]; then
  logged cp-choices-segments 300 python3 benchmarks/cp_choices.py --segments 24,32,40,48,64,80,96,128,192,224,256 \
    --out "$out/cp-choices-segments.json" --shape 4/16:12288+4096 --shape 16/16:24576+8192 --shape 2/8:24576+8192 \
    --shape 8/32:4096 --shape 16/32:8192 --shape 16/32:16384 --shape 16/32:32768 --shape 4/16:65536+65536
  tail -2 "$out/cp-choices-segments.log"
else
  echo "$usage" >&2
  exit 2
fi
