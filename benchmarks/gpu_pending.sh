#!/usr/bin/env bash
# What issues 27 and 29 measure on the GPU machine, in three device calls of under 10 minutes each (the device
# tool: 30 minutes a session, 10 a call; a refused start costs 90 s of it). From the project root there, after
# `bash ../shared/gpu/build-kit.sh` here (it writes .gpukit/):
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh whole     # issue 27's whole-command ratios (~480 s)
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh tests     # pytest -m gpu, then fresh vs warm
#                                                                           # (fastrecord bench's coldstart; ~140 s)
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh lerobot   # issue 29's >= 0.80x; replay 96 episodes
#   carry: [".gpukit", "build/before"]   command: bash benchmarks/gpu_pending.sh packed    # sub-envs packed (~560 s)
#   carry: [".gpukit", "build/before"]   command: bash benchmarks/gpu_pending.sh eval      # the eval's loop with
#                                         close: GPU tests, profile_eval this tree vs build/before/src, whole (~560 s)
# build/before/src (ignored by git) is the tree to compare against, made here first, e.g. for main before the render
# group's warm-up: mkdir -p build/before && git archive 9c16566 src | tar -x -C build/before
#   carry: [".gpukit", "build/before"]   command: bash benchmarks/gpu_pending.sh startup
#                                         # record and eval, this tree against build/before/src; 16 makes (~540 s)
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh replay_ahead   # the replay in one rendering process
#                                         (--workers 1 --vector async): its GPU tests, 96 episodes whole against the
#                                         default and ManiSkill, where its step goes (~300 s); `replay` and `replay480`:
#                                         the same with all the GPU tests and --floor, and at 480 episodes
#   carry: [".gpukit", "build/before"]   command: bash benchmarks/gpu_pending.sh ahead_and_eval   # replay_ahead, then
#                                         profile_eval of this tree and of BEFORE once each (~450 s): one lend for both
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh replay_split   # 96 episodes whole, default against
#                                         one rendering process; where the loop's time outside the steps goes (~260 s)
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh after_fixes    # the eval's profile, then 96 episodes
#                                         whole, default against one rendering process (~110 s)
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh coldstart   # a fresh process against a warm one, with
#                                         its timeline (SpanTrace); BEFORE=path/src adds another tree (~100 s a tree)
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh pinning     # probe_pinning: pinning, encoders' start
#   carry: [".gpukit", "build/before"]   command: bash benchmarks/gpu_pending.sh eval_close  # the eval's close and
#                                         first reset against build/before/src; whole eval and record; GPU tests (~420 s)
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh eval_encoders  # the eval's steps after its resets
#                                         without the profiler's timers, against fewer encoders (~330 s)
#   carry: [".gpukit", "build/before"]   command: bash benchmarks/gpu_pending.sh eval_gate  # encoders at once while
#                                         the sub-envs step: the eval, whole eval and record against BEFORE (~420 s);
#                                         COLDSTART=1 adds fastrecord bench's warm and fresh phases, NO_PROBE=1 skips
#                                         the sub-envs' camera probe, LEAN=1 the process per env and whole record
#   carry: [".gpukit", "build/before"]   command: bash benchmarks/gpu_pending.sh eval_pool  # the eval against BEFORE
#                                         (alternating), a process per env, the whole eval, the video paths' GPU
#                                         tests (~220 s); COLDSTART=1 adds fastrecord bench's warm and fresh phases,
#                                         PAIRS=N alternates N pairs (2), LEAN=1 skips the process per env
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh eval_split  # the eval's reset steps, first reset and
#                                         close split into their layers, the sub-env processes' included (~120 s)
#   carry: [".gpukit", "build/head"]   command: BEFORE=build/head/src bash benchmarks/gpu_pending.sh triton
#                                         # the yuv420p conversion without Triton against BEFORE: its cost a gather,
#                                         Triton's first call, fastrecord bench's fresh and warm phases (~400 s)
#   carry: [".gpukit", "build/head"]   command: BEFORE=build/head/src bash benchmarks/gpu_pending.sh replay_early
#                                         # the replay drawn in one process, its sub-envs started early: 96
#                                         episodes whole against BEFORE and ManiSkill, record's first step (~400 s)
#   carry: [".gpukit", "build/prev"]   command: BEFORE=build/prev/src bash benchmarks/gpu_pending.sh early_device
#                                         # record's render engine opened while the CLI imports: its GPU tests, then
#                                         record's time to first step against BEFORE in 3 alternating pairs (~400 s)
#   carry: [".gpukit", "build/head"]   command: BEFORE=build/head/src bash benchmarks/gpu_pending.sh first_step_pairs
#                                         # record's time to first step against BEFORE, each tree first once a
#                                         pair (PAIRS=2: ~200 s)
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh replay_videos   # the default replay with videos (the
#                                         join's linked videos), one rendering process, ManiSkill --save-video (~300 s)
#   carry: [".gpukit", "build/prev"]   command: BEFORE=build/prev/src bash benchmarks/gpu_pending.sh recorder_start
#                                         # where a worker's recorder start goes (probe_recorder_start), then 96
#                                         episodes whole against BEFORE (~200 s)
#   carry: [".gpukit", "build/prev"]   command: BEFORE=build/prev/src bash benchmarks/gpu_pending.sh starts
#                                         # after probe_recorder_start's findings: 96 episodes whole (equal and
#                                         staggered ends) and record's first step against BEFORE (~480 s)
#   carry: [".gpukit", "build/prev"]   command: BEFORE=build/prev/src bash benchmarks/gpu_pending.sh plan_cuda
#                                         # the plan's CUDA question by NVML: its cost in a fresh process, 96
#                                         episodes whole against BEFORE, the forkserver's preload stamped (~300 s)
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh deferred   # the imports deferred against Python's
#                                         own (-X importtime by package), record's first step with each, fresh
#                                         against warm (~450 s)
#   carry: [".gpukit"]   command: bash benchmarks/gpu_pending.sh replay_staggered   # 96 episodes that end at
#                                         different steps (bench_replay --policy pick), default and one rendering
#                                         process against ManiSkill; the default on a busy machine (~400 s)
# Each stage writes $OUT/<stage>/ (its output, JSON where the benchmark has it, nvidia-smi) and stops itself
# before the call's limit, so what it measured comes back (at most 8 files return from a call: a stage writes
# fewer). Last runs: `prestart` (09:43; now the stage `starts`, which also compiles GitPython in its warm-up),
# `recorder_start` (09:58), `starts` (10:16) and `first_step_pairs` with REPLAY=2 PAIRS=1 (10:27), 2026-12-07 on H100
# machines (docs/performance.md, "Replay workers' and recorders' starts"); `first_step_pairs` (PAIRS=3) at 07:21;
# `replay_early` and `replay_staggered` at 04:13.
set -uo pipefail
stage=${1:?usage: bash benchmarks/gpu_pending.sh early_device|deferred|starts|recorder_start|tests|triton|replay_videos|replay_early|replay_staggered|first_step_pairs|eval_pool|eval_gate|eval_encoders|eval_split|eval_close|coldstart|pinning|lerobot|whole|startup|packed|eval|replay|replay_ahead|ahead_and_eval|replay_split|after_fixes|replay480}
source .gpukit/setup.sh
out=${OUT:-/tmp/gpu-pending}/$stage
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >"$out/gpu.txt" 2>&1
nproc >>"$out/gpu.txt"
run() {  # run LIMIT NAME CMD...: CMD's output to $out/NAME.txt (and here), stopped after LIMIT seconds
  local limit=$1 name=$2
  shift 2
  echo "== $name: $*" | tee "$out/$name.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$out/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$out/$name.txt"
}
first_step_pairs() {  # first_step_pairs BEFORE N: record's time to first step against BEFORE, N pairs, each tree first once
  for i in $(seq "$2"); do
    run 80 "pair${i}_this_first" python3 benchmarks/bench_whole.py --size gpu --only record --skip-maniskill \
      --src "before=$PWD/$1"
    run 80 "pair${i}_before_first" python3 benchmarks/bench_whole.py --size gpu --only record --skip-maniskill \
      --src "before=$PWD/$1" --src-first
  done
}
case $stage in
  tests)
    run 280 pytest python3 -m pytest -m gpu tests -q -p no:cacheprovider -x --durations=10
    # a fresh process against a warm one (issue 27: >= 90%, all ending together and staggered): fastrecord bench's
    # fastrecord, staggered and coldstart phases, 128 envs x 512x512 CUDA frames
    run 280 coldstart python3 -m fastrecord bench --config configs/bench_h200.yaml \
      --skip ceiling,quality,maniskill,keepup,realenv,micro,imageobs,cpueval --json "$out/coldstart.json" \
      --output-dir /tmp/bench-videos
    ;;
  lerobot)
    run 300 lerobot_speed python3 -m benchmarks.bench_lerobot_speed --num-envs 128 --size 128 --steps 200 \
      --json "$out/lerobot_speed.json"
    run 250 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16
    ;;
  whole)
    run 570 whole python3 benchmarks/bench_whole.py --size gpu --json "$out/whole.json"
    ;;
  startup)
    # issue 27's start-up: record and eval against ManiSkill's ways, with the source tree of BEFORE (a src folder,
    # default build/before/src: carry it) beside; then where 16 sub-env makes together spend their seconds
    before=${BEFORE:-build/before/src}
    run 330 whole python3 benchmarks/bench_whole.py --size gpu --only record,eval --src "before=$PWD/$before" \
      --json "$out/whole.json"
    run 100 probe python3 -m benchmarks.probe_make_contention --num 16 --backend gpu \
      --variants alone,together,frozen_alone,frozen,fork,packed,frozen_packed,frozen_none --json "$out/probe.json"
    run 130 pytest python3 -m pytest -m gpu tests -q -p no:cacheprovider -x --durations=5
    ;;
  packed)
    # the batched render's sub-envs several to a process (fastrecord.packed), started before the CLI's imports: the GPU
    # tests first (the new path's pictures), then record and eval against ManiSkill's ways and BEFORE (~450 s in all);
    # SWEEP=1 adds a labelled sweep of one env a process beside the default (~60 s more)
    before=${BEFORE:-build/before/src}
    run 120 pytest python3 -m pytest -m gpu tests/test_batched_render.py -q -p no:cacheprovider -x --durations=5
    run 400 whole python3 benchmarks/bench_whole.py --size gpu --only record,eval --src "before=$PWD/$before" \
      --envs-per-process "${SWEEP:-}" --json "$out/whole.json"
    ;;
  eval)
    # the eval's loop with close (issue 27: >= 800 env-steps/s): the batched-render GPU tests first (the render
    # group warmed in the mirrors' thread), then benchmarks.profile_eval of this tree and of BEFORE alternating
    # (first reset, steps with and without resets, close, each layer timed), then record and eval whole
    before=${BEFORE:-build/before/src}
    run 120 pytest python3 -m pytest -m gpu tests/test_batched_render.py -q -p no:cacheprovider -x --durations=5
    for i in 1 2; do
      run 80 "profile_this_$i" python3 -m benchmarks.profile_eval --variants default --json "$out/profile_this_$i.json"
      PYTHONPATH="/tmp/gpukit:$PWD/$before:$PWD" run 80 "profile_before_$i" python3 -m benchmarks.profile_eval \
        --variants default --json "$out/profile_before_$i.json"
    done
    run 260 whole python3 benchmarks/bench_whole.py --size gpu --only eval,record --skip-maniskill \
      --src "before=$PWD/$before" --json "$out/whole.json"
    ;;
  replay)
    # issue 27's replay (>= 2x ManiSkill at 96 and 480 episodes) and item 2: the batched-render GPU tests of the
    # replay (the mirrored path: sub-envs in processes, one rendering process), then 96 episodes: the default layout
    # (4 workers of 4 envs drawn in their own process) against one process drawing 16 sub-envs (--vector async)
    run 170 pytest python3 -m pytest -m gpu tests/test_replay_batched_render.py -q -p no:cacheprovider --durations=5
    run 380 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16 --floor \
      --also "--workers 1 --vector async"
    ;;
  replay_ahead)
    # the same after the sub-envs ran their whole next step ahead (not only its physics): the mirrored GPU tests,
    # 96 episodes whole, then where a mirrored step goes (benchmarks.profile_replay)
    run 100 pytest python3 -m pytest -m gpu tests/test_replay_batched_render.py -k async -q -p no:cacheprovider
    run 200 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16 --stamps \
      --also "--workers 1 --vector async"
    run 150 profile python3 -m benchmarks.profile_replay --episodes 96 --num-envs 16 --variants async_per2,async \
      --json "$out/profile_replay.json"
    ;;
  ahead_and_eval)
    # one call for both open questions, most important first (a lend is rare): replay_ahead's runs, then the eval's
    # first reset and close with the render group warmed in the mirrors' thread, against BEFORE (one profile each)
    before=${BEFORE:-build/before/src}
    run 90 pytest python3 -m pytest -m gpu tests/test_replay_batched_render.py -k async -q -p no:cacheprovider
    run 180 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16 --stamps --floor \
      --also "--workers 1 --vector async"
    run 120 profile python3 -m benchmarks.profile_replay --episodes 96 --num-envs 16 --variants async_per2,async \
      --json "$out/profile_replay.json"
    run 70 profile_eval_this python3 -m benchmarks.profile_eval --variants default --json "$out/profile_this.json"
    PYTHONPATH="/tmp/gpukit:$PWD/$before:$PWD" run 70 profile_eval_before python3 -m benchmarks.profile_eval \
      --variants default --json "$out/profile_before.json"
    ;;
  replay_split)
    # after ahead_and_eval (2026-12-06, H100: the mirrored step at 1.16x the drawing, the loop 2.9 s longer than its
    # steps): 96 episodes whole, the default against the mirrored layout and ManiSkill, then where the loop's time
    # outside the steps goes (episodes flushed, input read, close); the eval's profile. Six files back (at most 8 return)
    run 200 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16 --stamps --floor \
      --also "--workers 1 --vector async"
    run 100 profile python3 -m benchmarks.profile_replay --episodes 96 --num-envs 16 --variants async,sync \
      --json "$out/profile_replay.json"
    # the eval's 16 mirror builds each held a full collection of ~140 ms (ahead_and_eval): which thread, how much frozen
    run 60 profile_eval python3 -m benchmarks.profile_eval --variants default --json "$out/profile_eval.json"
    ;;
  after_fixes)
    # the eval's mirrors built inside their own freeze and the replay's flush without torch's CPU indexing
    # (2026-12-06): the eval's profile first (its make and its full collections), then 96 episodes whole, the default
    # (4 workers) against one rendering process and ManiSkill
    run 60 profile_eval python3 -m benchmarks.profile_eval --variants default --json "$out/profile_eval.json"
    run 200 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16 --stamps \
      --also "--workers 1 --vector async"
    ;;
  coldstart)
    # a fresh process against a warm one (issue 27: >= 90%, all ending together and staggered), 128 envs x 512x512
    # CUDA frames: fastrecord bench's warm phases and its coldstart phase, whose fresh processes now write their
    # timeline from construction (what ran when, how many encoders were busy in each quarter second: SpanTrace).
    # BEFORE=path/to/src runs that tree's coldstart too, in the same call (~100 s a tree)
    for tree in src ${BEFORE:-}; do
      tag=this; [ "$tree" = src ] || tag=before
      PYTHONPATH="$tree:$PYTHONPATH" run 280 "coldstart_$tag" python3 -m fastrecord bench \
        --config configs/bench_h200.yaml --skip ceiling,quality,maniskill,keepup,realenv,micro,imageobs,cpueval \
        --json "$out/coldstart_$tag.json" --output-dir /tmp/bench-videos
    done
    ;;
  pinning)
    # what a fresh process's first staging memory and encoders wait for (benchmarks/probe_pinning.py, ~60 s)
    run 200 pinning python3 -m benchmarks.probe_pinning --gib 2.4 --json "$out/pinning.json"
    ;;
  eval_split)
    # the eval's steps where every env resets (4 of 200, 192-330 ms each against 16 ms) and its first reset and close:
    # each reset step's layers, and the sub-env processes' own timers (their reconfiguring resets, the pose reports)
    run 200 profile_eval python3 -m benchmarks.profile_eval --variants default,per_process_1,no_video \
      --json "$out/profile_eval.json"
    ;;
  eval_close)
    # the eval's close (sub-envs' exits awaited on a thread, the mirrors' collection left for later) and first reset
    # (scene signatures warmed at make), this tree against BEFORE (default build/before/src), alternating; then the
    # whole commands (the eval with ManiSkill's evals, record without) and the GPU tests of the touched paths
    before=${BEFORE:-build/before/src}
    for i in ${REPEAT:-1}; do
      run 80 "profile_this_$i" python3 -m benchmarks.profile_eval --variants default
      PYTHONPATH="/tmp/gpukit:$PWD/$before:$PWD" run 80 "profile_before_$i" python3 -m benchmarks.profile_eval \
        --variants default
    done 2>&1 | grep "==\|steps with\|reset step\|stamps"
    run 200 whole_eval python3 benchmarks/bench_whole.py --size gpu --only eval --src "before=$PWD/$before"
    run 120 whole_record python3 benchmarks/bench_whole.py --size gpu --only record --skip-maniskill \
      --src "before=$PWD/$before"
    run 150 pytest python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_batched_render.py \
      tests/test_make_eval_envs.py tests/test_record_subenvs.py tests/test_replay_batched_render.py -k "not peg"
    ;;
  eval_encoders)
    # what the eval's steps after a reset and its reset steps pay to the 16 encoders starting then, without the
    # profiler's timers (--light): the default against fewer encoders, a process per env and no video; then a
    # sub-env's reconfiguring reset alone, 8 processes of 2 and 16 of 1 at once (~330 s)
    run 200 profile_light python3 -m benchmarks.profile_eval --light \
      --variants default,video_workers_4,video_workers_8,per_process_1,no_video,default --json "$out/profile_light.json"
    run 90 probe_8x2 python3 -m benchmarks.probe_reconfigure --resets 6 --variants eval_like --together 8x2
    run 90 probe_16x1 python3 -m benchmarks.probe_reconfigure --resets 6 --variants eval_like --together 16x1
    run 120 whole_record python3 benchmarks/bench_whole.py --size gpu --only record --skip-maniskill
    ;;
  eval_gate)
    # the encoders that run at once while a CPU vector env's sub-envs step (the cores they leave; all at close):
    # the eval without the profiler's timers, this tree against BEFORE (default build/before/src), alternating; then
    # the whole eval and record against BEFORE, and the GPU tests of the touched paths (~420 s)
    before=${BEFORE:-build/before/src}
    for i in 1 2; do
      run 60 "light_this_$i" python3 -m benchmarks.profile_eval --light --variants default
      PYTHONPATH="/tmp/gpukit:$PWD/$before:$PWD" run 60 "light_before_$i" python3 -m benchmarks.profile_eval --light \
        --variants default
    done 2>&1 | grep "==\|steps\|of which"
    [ -z "${LEAN:-}" ] && run 60 light_this_pp1 python3 -m benchmarks.profile_eval --light --variants per_process_1 | grep "==\|steps\|of which"
    run 150 whole_eval python3 benchmarks/bench_whole.py --size gpu --only eval --skip-maniskill \
      --src "before=$PWD/$before"
    [ -z "${LEAN:-}" ] && run 120 whole_record python3 benchmarks/bench_whole.py --size gpu --only record \
      --skip-maniskill --src "before=$PWD/$before"
    run 100 pytest python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_make_eval_envs.py \
      tests/test_record_subenvs.py tests/test_batched_render.py tests/test_video.py -k "not peg"
    [ -n "${COLDSTART:-}" ] && run 200 coldstart python3 -m fastrecord bench --config configs/bench_h200.yaml \
      --skip ceiling,quality,maniskill,keepup,realenv,micro,imageobs,cpueval --json "$out/coldstart.json" \
      --output-dir /tmp/bench-videos | grep -i "env-frames/s\|fresh\|coldstart\|warm"
    [ -n "${NO_PROBE:-}" ] && exit 0
    # what the sub-envs' own 512x512 human camera (never drawn there: the mirrors draw) costs their make and resets
    run 90 probe_camera python3 -m benchmarks.probe_reconfigure --resets 4 --variants gpu,gpu_small_camera --together 8x2
    ;;
  eval_pool)
    # the encoder pool's longest-idle order and the floor of a quarter of the writers, which eval_gate's run at
    # 12:30 on 2026-12-06 had not: the eval against BEFORE alternating, a process per env, the whole eval, fastrecord
    # bench's warm and fresh phases (COLDSTART=1), the GPU tests of the video paths (~220 s; ~280 s with COLDSTART)
    before=${BEFORE:-build/before/src}
    # the page cache warmed first: a fresh machine's first process read its imports from disk (make 4.7 s against
    # 3.4-3.9 s, its first reset step 288 ms at 14:31 on 2026-12-06)
    python3 -c "import torch, sapien, mani_skill.envs, av, fastrecord.make_env" >/dev/null 2>&1
    for i in $(seq 1 "${PAIRS:-2}"); do
      run 60 "light_this_$i" python3 -m benchmarks.profile_eval --light --variants default
      PYTHONPATH="/tmp/gpukit:$PWD/$before:$PWD" run 60 "light_before_$i" python3 -m benchmarks.profile_eval --light \
        --variants default
    done 2>&1 | grep "==\|steps\|of which\|encoders:"
    [ -z "${LEAN:-}" ] && run 60 light_this_pp1 python3 -m benchmarks.profile_eval --light --variants per_process_1 \
      | grep "==\|steps\|of which\|encoders:"
    run 150 whole_eval python3 benchmarks/bench_whole.py --size gpu --only eval --skip-maniskill \
      --src "before=$PWD/$before"
    [ -n "${COLDSTART:-}" ] && run 170 coldstart python3 -m fastrecord bench --config configs/bench_h200.yaml \
      --skip ceiling,quality,maniskill,keepup,realenv,micro,imageobs,cpueval --json "$out/coldstart.json" \
      --output-dir /tmp/bench-videos | grep -i "env-frames/s\|fresh\|coldstart\|warm"
    run 150 pytest python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_batched.py tests/test_buffer.py \
      tests/test_batched_render.py -k "not peg"
    ;;
  triton)
    # the yuv420p conversion without Triton (2026-12-06; issue 27's fresh process: the kernel's load held the GIL for
    # 0.8 s at 3.37 s of the 14:25 fresh run): what a gather's conversion costs in this tree and in BEFORE (a src
    # tree, e.g. build/head/src: torch's kernels and Triton's, and Triton's first call; benchmarks/probe_yuv.py), then
    # fastrecord bench's warm and fresh phases of this tree and BEFORE, alternating PAIRS times (1), then the GPU tests
    # of the video paths (the CUDA overlay test among them); REPLAY=1 adds the 96-episode replay (~420 s)
    python3 -c "import torch, sapien, mani_skill.envs, av, fastrecord.make_env" >/dev/null 2>&1
    probes="src ${BEFORE:-}"
    [ -n "${ONLY_COLDSTART:-}" ] && probes=""  # ONLY_COLDSTART=1: the bench's phases alone
    for tree in $probes; do
      tag=this; [ "$tree" = src ] || tag=before
      PYTHONPATH="$PWD/$tree:$PYTHONPATH" run 90 "probe_yuv_$tag" python3 -m benchmarks.probe_yuv
    done
    # `fastrecord bench` runs the benchmarks of its own checkout: a bare src tree gets a copy of this one's (a link
    # resolves elsewhere, which the bench of trees before 2026-12-06 refused)
    [ -n "${BEFORE:-}" ] && [ ! -e "$(dirname "$BEFORE")/benchmarks" ] && cp -r "$PWD/benchmarks" "$(dirname "$BEFORE")/"
    for i in $(seq 1 "${PAIRS:-1}"); do
      for tree in src ${BEFORE:-}; do
        tag=this; [ "$tree" = src ] || tag=before
        PYTHONPATH="$PWD/$tree:$PYTHONPATH" run 150 "coldstart_${tag}_$i" python3 -m fastrecord bench \
          --config configs/bench_h200.yaml --skip ceiling,quality,maniskill,keepup,realenv,micro,imageobs,cpueval \
          --output-dir /tmp/bench-videos | grep -i "env-frames/s\|fresh\|coldstart\|warm\|first reset"
      done
    done
    [ -n "${ONLY_COLDSTART:-}" ] && exit 0
    for tree in src ${TESTS_BEFORE:+$BEFORE}; do  # TESTS_BEFORE=1: BEFORE's source under the same tests too
      tag=this; [ "$tree" = src ] || tag=before
      PYTHONPATH="$PWD/$tree:$PYTHONPATH" run 120 "pytest_$tag" python3 -m pytest -m gpu -q -rA -p no:cacheprovider \
        tests/test_batched.py tests/test_video.py tests/test_buffer.py -k "not peg" | grep -v "^  \|^$\|Warning"
    done
    [ -n "${REPLAY:-}" ] && run 150 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16 \
      --stamps
    ;;
  replay_early)
    # the replay drawn in one process (--workers 1 --vector async), its sub-envs started before the CLI's imports and
    # (since 2026-12-06 21:30) four to a process, and record's early sub-envs no longer behind torch's import: 96
    # episodes whole, this tree's default (4 workers, each worker's phases printed: --stamps) and the one rendering
    # process against BEFORE's default and ManiSkill (REPEAT times, 1); record's time to first step against BEFORE;
    # the GPU tests of the replay drawn in one process (~400 s)
    before=${BEFORE:-build/before/src}
    python3 -c "import torch, sapien, mani_skill.envs, av, fastrecord.make_env" >/dev/null 2>&1
    run 330 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16 --stamps --floor \
      --also "--workers 1 --vector async" --src "before=$PWD/$before" --repeat "${REPEAT:-1}"
    [ -z "${NO_RECORD:-}" ] && run 110 whole_record python3 benchmarks/bench_whole.py --size gpu --only record \
      --skip-maniskill --src "before=$PWD/$before"
    run 100 pytest python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_replay_early.py \
      tests/test_replay_batched_render.py -k "async and not peg or one_process"
    ;;
  replay_staggered)
    # the replay of episodes that end at different steps, as a policy's evaluation leaves them (the scripted PickCube
    # policy: its successes end at 12-20 steps, its failures at 80): 96 episodes whole, this tree's default and the
    # one rendering process against ManiSkill, with each command's phases; then the default and ManiSkill on a busy
    # machine (~400 s)
    python3 -c "import torch, sapien, mani_skill.envs, av, fastrecord.make_env" >/dev/null 2>&1
    rm -rf /tmp/staggered  # this stage's own folder: an earlier run's input there would stop bench_replay
    run 300 replay96_staggered python3 benchmarks/bench_replay.py --episodes 96 --steps 80 --policy pick \
      --num-envs 16 --stamps --also "--workers 1 --vector async" --work-dir /tmp/staggered
    # the same input on a busy machine: 8 of the 16 cores spun by other processes, the default against ManiSkill
    run 200 replay96_staggered_busy python3 benchmarks/bench_replay.py --traj /tmp/staggered/input/pickcube.h5 \
      --num-envs 16 --busy 8
    ;;
  recorder_start)
    # where a replay worker's recorder start goes (1.7-1.9 s on the H100 at 09:45, 0.05 s on the CPU machine): 4
    # processes as the default's workers, each profiled (probe_recorder_start); then 96 episodes whole against BEFORE
    # and ManiSkill once, with the workers' phases (workers taking the next episode from one counter, the input checked
    # while they make their envs) (~200 s)
    before=${BEFORE:-build/before/src}
    python3 -c "import torch, sapien, mani_skill.envs, av, fastrecord.make_env" >/dev/null 2>&1
    run 100 probe python3 benchmarks/probe_recorder_start.py --procs 4
    run 150 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16 --stamps --floor \
      --src "before=$PWD/$before"
    ;;
  plan_cuda)
    # the plan's CUDA question answered by NVML (`fastrecord.system.torch_sees_cuda`) against BEFORE: what each way of
    # asking costs a fresh process (probe_cuda_check), then 96 episodes whole against BEFORE and ManiSkill (REPEAT
    # times, 2) with the forkserver's preload stamped (~300 s)
    before=${BEFORE:-build/prev/src}
    python3 -c "import torch, sapien, mani_skill.envs, av, fastrecord.make_env, fastrecord.replay.workers" >/dev/null 2>&1
    PYTHONPATH="$before:${PYTHONPATH:-}" python3 -c "import fastrecord.replay.workers" >/dev/null 2>&1
    run 60 cuda_check python3 -m benchmarks.probe_cuda_check --reps 3
    run 400 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16 --stamps \
      --src "before=$PWD/$before" --repeat "${REPEAT:-2}"
    ;;
  starts)
    # the workers' and the recorder's start after probe_recorder_start (the writer's first index on a thread of its
    # own, commit_info without GitPython where ManiSkill is no checkout; workers taking episodes from one counter, the
    # input checked while they make their envs): 96 episodes whole against BEFORE and ManiSkill (REPEAT times, 2),
    # every episode 50 steps; then episodes that end at different steps; record's time to first step against BEFORE.
    # GitPython is compiled in the warm-up too (the kit has no .pyc files; BEFORE imports it in every recorder) (~480 s)
    before=${BEFORE:-build/before/src}
    python3 -c "import torch, sapien, mani_skill.envs, av, git, fastrecord.make_env" >/dev/null 2>&1
    run 200 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 --num-envs 16 --stamps --floor \
      --src "before=$PWD/$before" --repeat "${REPEAT:-2}"
    rm -rf /tmp/staggered
    run 230 replay96_staggered python3 benchmarks/bench_replay.py --episodes 96 --steps 80 --policy pick \
      --num-envs 16 --stamps --src "before=$PWD/$before" --work-dir /tmp/staggered
    [ -z "${NO_RECORD:-}" ] && run 80 whole_record python3 benchmarks/bench_whole.py --size gpu --only record \
      --skip-maniskill --src "before=$PWD/$before"
    ;;
  deferred)
    # the imports deferred (`fastrecord.deferred`) against Python's own, fresh interpreters alternating, with each
    # way's -X importtime by package; record's time to first step with them and with FASTRECORD_DEFER_IMPORTS=0;
    # fastrecord bench's fresh and warm phases (~450 s)
    python3 -c "import torch, sapien, mani_skill.envs, av, fastrecord.make_env, matplotlib.pyplot, requests" \
      >/dev/null 2>&1
    run 120 imports python3 -m benchmarks.probe_deferred --reps 3 --skip-command --importtime
    run 80 first_step python3 benchmarks/bench_whole.py --size gpu --only record --skip-maniskill
    FASTRECORD_DEFER_IMPORTS=0 run 80 first_step_undeferred python3 benchmarks/bench_whole.py --size gpu \
      --only record --skip-maniskill
    run 230 coldstart python3 -m fastrecord bench --config configs/bench_h200.yaml \
      --skip ceiling,quality,maniskill,keepup,realenv,micro,imageobs,cpueval --json "$out/coldstart.json" \
      --output-dir /tmp/bench-videos
    ;;
  early_device)
    # record's render engine opened while the CLI imports (fastrecord.render.device, not yet run on a GPU): its GPU
    # tests and the batched render's, then record's time to first step against BEFORE (the tree before it), PAIRS
    # times (3), each tree's 16-env job first once a pair; the envs phase's lines show when the device opened (~400 s)
    before=${BEFORE:-build/prev/src}
    python3 -c "import torch, sapien, mani_skill.envs, av, git, fastrecord.make_env" >/dev/null 2>&1
    run 150 pytest python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_render_device.py \
      tests/test_batched_render.py -x
    first_step_pairs "$before" "${PAIRS:-3}"
    ;;
  first_step_pairs)
    # record's time to first step, this tree against BEFORE, PAIRS times (2), each tree's 16-env job first once a pair
    # (bench_whole --src-first); ~100 s a pair. REPLAY=N first runs the 96-episode replay against BEFORE N times
    # (~90 s each). GitPython is compiled in the warm-up (the kit has no .pyc files; trees before 666d5b7 import it)
    before=${BEFORE:-build/before/src}
    python3 -c "import torch, sapien, mani_skill.envs, av, git, fastrecord.make_env" >/dev/null 2>&1
    [ -n "${REPLAY:-}" ] && run 200 replay96 python3 benchmarks/bench_replay.py --episodes 96 --steps 50 \
      --num-envs 16 --stamps --src "before=$PWD/$before" --repeat "${REPLAY}"
    first_step_pairs "$before" "${PAIRS:-2}"
    ;;
  replay_videos)
    # the replay users get by default, with videos (the join links each episode's video next to NAME.h5): 96 PickCube
    # episodes x 50 steps in 16 envs, whole commands, against one rendering process and ManiSkill's tool with
    # --save-video; each output's videos counted (~300 s)
    rm -rf /tmp/rv && mkdir -p /tmp/rv
    run 120 record python3 -m fastrecord record PickCube-v1 --num-envs 16 --episodes 96 --max-episode-steps 50 \
      --no-video --output-dir /tmp/rv/in --trajectory-name demo
    cp -r /tmp/rv/in /tmp/rv/in_ms
    for what in default one_process maniskill; do
      t0=$(date +%s.%N)
      case $what in
        default) run 150 replay_default python3 -m fastrecord replay /tmp/rv/in/demo.h5 --num-envs 16 \
                   --output-dir /tmp/rv/default ;;
        one_process) run 150 replay_one_process python3 -m fastrecord replay /tmp/rv/in/demo.h5 --num-envs 16 \
                   --workers 1 --vector async --output-dir /tmp/rv/one ;;
        maniskill) run 150 replay_maniskill python3 -m mani_skill.trajectory.replay_trajectory \
                   --traj-path /tmp/rv/in_ms/demo.h5 --use-env-states -n 16 --save-video --allow-failure ;;
      esac
      t1=$(date +%s.%N)
      echo "$what: $(python3 -c "print(round($t1 - $t0, 1))") s whole" | tee -a "$out/summary.txt"
    done
    for d in default one in_ms; do
      echo "$d: $(ls /tmp/rv/$d/*.mp4 2>/dev/null | wc -l) videos in the folder, $(find /tmp/rv/$d -name '*.mp4' \
        -links +1 | wc -l) hard-linked" | tee -a "$out/summary.txt"
    done
    ;;
  replay480)
    run 590 replay480 python3 benchmarks/bench_replay.py --episodes 480 --steps 50 --num-envs 16 \
      --also "--workers 1 --vector async"
    ;;
  *)
    echo "unknown stage $stage: see the usage line" >&2
    exit 2
    ;;
esac
exit 0
