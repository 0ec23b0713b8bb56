"""Faults injected into real multi-worker training, and a soak: figures for docs/reliability.md.

Each fault scenario runs ``benchmarks/fault_worker.py`` in 2 worker processes
(``MultiWorkerMirroredStrategy`` over gRPC on 127.0.0.1, ``CompressedOptimizer``
with AdaComp, ``tf_adacomp.BackupAndRestore`` every ``--save_freq`` steps), kills one
worker with SIGKILL at the scenario's point, then restarts the whole job, which resumes
from the backup. Per scenario it reports how long the surviving worker took to fail,
the step the job resumed at against the last backup completed, whether the restored
residue totals are those that backup saved, whether the workers' weights are
bit-identical after restoring and at the end, and the final test accuracy against an
uninterrupted run of the same steps.

Scenarios: ``mid_epoch`` (worker 1 at a step inside an epoch), ``chief`` (worker 0, the
one whose backup is kept), ``before_backup`` (before the first backup: the job starts
over), ``save_worker`` and ``save_chief`` (while writing a backup, half the file
written), ``stalled`` (worker 1 not killed but asleep, alive: its peer is freed by
``--collective_timeout`` alone), ``local_steps`` (rounds of ``--local_steps`` steps,
4 unless given, with ``--outer_optimizer`` nesterov unless given: worker 1 killed in the
middle of a round, after a backup that itself fell mid-round; see below).

``--local_steps`` and ``--outer_optimizer`` (average, or nesterov: DiLoCo's,
``tf_adacomp.local_steps.diloco()``) go to every scenario's workers; by default the
others run with 1 step per round (the library's default) and ``local_steps`` with 4 and
nesterov. Between round ends each worker holds its own weights and a backup stores the
chief's, so the ``local_steps`` scenario also reports whether the backup file holds the
anchor the workers held bit for bit, whether the anchors and the outer optimizer's
state that the workers restored are those the file holds, whether the restored weights
are the chief's at that backup, and whether rounds still end at the multiples of H
before the kill, after the resume and in the uninterrupted run (``iterations`` resumes
at the backup's step; a round's end is a step that sent bytes). Its backups come every
``--save_freq`` steps, or one fewer where that is a multiple of H (every backup would
fall at a round's end); the kill is the first step after a mid-round backup that is
itself mid-round, preferring a backup from which the resumed job ends at a round's end
(a job that stops mid-round leaves each worker its own weights). Known library bug it
reports: a backup stores the anchors as the mean over replicas of a value equal on all
(``aggregation="mean"``), and the mean of 3 equal float32 copies is not always that
value: with ``--workers 3`` some entries differ by an ulp and ``anchors_saved_exactly``
is false (with 2 it is exact).

``--soak_steps N`` instead trains the Fashion-MNIST CNN with AdaComp for N steps on 4
replicas (``MirroredStrategy`` over 4 logical CPUs, one process) and reports the
residue norm, resident memory and replica agreement every ``--record_every`` steps.

Usage::

    python benchmarks/faults.py --json faults.json                  # every scenario
    python benchmarks/faults.py --scenarios mid_epoch --epochs 2    # one, shorter
    python benchmarks/faults.py --scenarios local_steps --epochs 2 --steps_per_epoch 6 --save_freq 3
    python benchmarks/faults.py --soak_steps 3000 --json soak.json
"""

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fault_worker.py")
# name -> (worker killed, fault arguments); "{mid}" is a step inside the second epoch.
SCENARIOS = {
    "mid_epoch": (1, ["--kill_at_step", "{mid}"]),
    "chief": (0, ["--kill_at_step", "{mid}"]),
    "before_backup": (1, ["--kill_at_step", "2"]),
    "save_worker": (1, ["--kill_during_save", "3"]),
    "save_chief": (0, ["--kill_during_save", "3"]),
    "stalled": (1, ["--stall_at_step", "{mid}", "--stall_seconds", "{stall}"]),
    # "{mid_round}": a step inside a round, after a backup that fell inside a round.
    "local_steps": (1, ["--kill_at_step", "{mid_round}"]),
}
# The local_steps scenario's rounds unless --local_steps / --outer_optimizer say otherwise.
LOCAL_STEPS_DEFAULT = 4
OUTER_DEFAULT = "nesterov"


def parse(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                      help=f"comma-separated, of {', '.join(SCENARIOS)}")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--data", default="digits", choices=("digits", "fashion_mnist"))
  parser.add_argument("--model", default="mlp", choices=("mlp", "cnn"))
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--steps_per_epoch", type=int, default=10)
  parser.add_argument("--save_freq", type=int, default=4)
  parser.add_argument("--local_steps", type=int, default=None,
                      help=f"steps per round for every scenario (default: 1, and "
                           f"{LOCAL_STEPS_DEFAULT} for the local_steps scenario)")
  parser.add_argument("--outer_optimizer", default=None, choices=("average", "nesterov"),
                      help=f"the rounds' outer step (default: average, and "
                           f"{OUTER_DEFAULT} for the local_steps scenario)")
  parser.add_argument("--collective_timeout", type=float, default=60.0)
  parser.add_argument("--timeout", type=float, default=420.0, help="seconds per job run")
  parser.add_argument("--soak_steps", type=int, default=0)
  parser.add_argument("--record_every", type=int, default=100)
  parser.add_argument("--no_baseline", action="store_true",
                      help="skip the uninterrupted run (no accuracy to compare with)")
  parser.add_argument("--json", default=None, help="write the figures here")
  parser.add_argument("--keep", action="store_true", help="keep the work folder")
  args = parser.parse_args(argv)
  if args.local_steps is not None and args.local_steps < 1:
    parser.error(f"--local_steps must be an integer >= 1. Received: "
                 f"--local_steps={args.local_steps}")
  return args


def _free_ports(count):
  sockets = [socket.socket() for _ in range(count)]
  try:
    for s in sockets:
      s.bind(("127.0.0.1", 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def run_job(worker_args, workers, out_dir, timeout):
  """Runs one job of ``workers`` processes; returns their records and return codes.

  A worker that fails gets its peers ``timeout`` seconds in all to fail or finish: the
  point is to see them fail on their own (the collective timeout, TensorFlow's
  heartbeats), so nothing is killed early.
  """
  from tf_adacomp.distribute import tf_config  # pylint: disable=g-import-not-at-top
  os.makedirs(out_dir, exist_ok=True)
  addresses = [f"127.0.0.1:{p}" for p in _free_ports(workers)] if workers > 1 else []
  processes = []
  for index in range(workers):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    if addresses:
      env["TF_CONFIG"] = tf_config(addresses, index)
    log = open(os.path.join(out_dir, f"worker{index}.log"), "w")
    processes.append((subprocess.Popen([sys.executable, WORKER, "--out_dir", out_dir,
                                        *worker_args], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
  deadline = time.monotonic() + timeout
  for process, log in processes:
    try:
      process.wait(max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      process.kill()  # only ours, and only past the deadline: reported as a hang
      process.wait()
    log.close()
  records = []
  for index, (process, _) in enumerate(processes):
    path = os.path.join(out_dir, f"worker{index}.json")
    record = json.load(open(path)) if os.path.exists(path) else {}
    record["returncode"] = process.returncode
    records.append(record)
  return records


def scenario(name, args, work, baseline):
  """Kills a worker as ``name`` says, restarts the job, and measures the resumed run."""
  victim, fault = SCENARIOS[name]
  mid = args.steps_per_epoch + args.steps_per_epoch // 2 - 1  # not a save step either
  stall = args.collective_timeout + 30  # outlives the timeout, then fails too
  local_steps, outer, save_freq, planned = _plan(name, args)
  mid_round = planned[1] if planned else None
  fault = [a.replace("{mid}", str(mid)).replace("{stall}", str(stall))
           .replace("{mid_round}", str(mid_round)) for a in fault]
  backup = os.path.join(work, name, "backup")
  common = _common(args, backup, local_steps, outer, save_freq)
  start = time.monotonic()
  killed = run_job(common + ["--kill_worker", str(victim), *fault], args.workers,
                   os.path.join(work, name, "killed"), args.timeout)
  killed_seconds = time.monotonic() - start
  resumed = run_job(common, args.workers, os.path.join(work, name, "resumed"), args.timeout)
  dead = killed[victim]
  survivors = [r for i, r in enumerate(killed) if i != victim]
  fault_time = dead.get("killed_at", dead.get("stalled_at"))
  detect = [r["failed_at"] - fault_time for r in survivors
            if "failed_at" in r and fault_time is not None]
  # The backup the job must resume from: the last one the chief completed.
  chief_saves = killed[0].get("saves", [])
  expected = chief_saves[-1]["step"] if chief_saves else 0
  saved_digest = chief_saves[-1]["residue_digest"] if chief_saves else None
  steps_total = args.epochs * args.steps_per_epoch
  row = {
      "scenario": name, "killed_worker": victim, "killed_at_step": dead.get("step"),
      "killed_during_save": dead.get("during_save"),
      "victim_returncode": dead.get("returncode"),
      "survivors_failed": all(r.get("returncode") not in (0, None) and "failed_at" in r
                              for r in survivors),
      "survivor_errors": sorted({r.get("error", "none") for r in survivors}),
      "survivor_returncodes": [r.get("returncode") for r in survivors],
      "seconds_to_fail": max(detect) if detect else None,
      "killed_run_seconds": killed_seconds,
      "resumed_returncodes": [r["returncode"] for r in resumed],
      "resumed_at": sorted({r.get("resumed_at") for r in resumed}, key=str),
      "expected_resume": expected,
      "residues_restored": (all(r.get("restored_residue_digest") == saved_digest
                                for r in resumed) if saved_digest else
                            all(not any(r.get("restored_residue_sums", [1])) for r in resumed)),
      "restored_weights_identical": len({r.get("restored_weights") for r in resumed}) == 1,
      "final_weights_identical": len({r.get("final_weights") for r in resumed}) == 1,
      "steps": resumed[0].get("steps"),
      # A resumed epoch is trained again from its first batch: more steps in all.
      "steps_expected": _resumed_steps(expected, args),
      "uninterrupted_steps": steps_total,
      "accuracy": resumed[0].get("accuracy"),
      "uninterrupted_accuracy": baseline.get("accuracy"),
  }
  row["ok"] = bool(
      row["survivors_failed"] and row["resumed_returncodes"] == [0] * args.workers
      and row["resumed_at"] == [expected] and row["residues_restored"]
      and row["restored_weights_identical"] and row["final_weights_identical"]
      and row["steps"] == row["steps_expected"])
  if name == "local_steps":
    row.update(_round_checks(args, local_steps, outer, save_freq, planned, killed,
                             resumed, baseline, expected, row))
    row["ok"] = row["ok"] and row["rounds_ok"]
  return row


def _round_checks(args, local_steps, outer, save_freq, planned, killed, resumed, baseline,
                  expected, row):
  """The local_steps scenario's own figures: the backup and the kill fell mid-round, the
  anchors and the outer optimizer's state restored are the backup's, the weights
  restored are the chief's at that backup, and rounds end at multiples of H before the
  kill, after the resume and in the uninterrupted run."""
  chief_saves = killed[0].get("saves", [])
  last = chief_saves[-1] if chief_saves else {}
  multiples = lambda first, last_step: [s for s in range(first + 1, last_step + 1)
                                        if s % local_steps == 0]
  steps = row["steps"] or 0
  checks = {
      "local_steps": local_steps, "outer_optimizer": outer, "save_freq": save_freq,
      "planned_backup": planned[0], "backup_mid_round": expected % local_steps != 0,
      "kill_mid_round": (row["killed_at_step"] or 0) % local_steps != 0,
      # The anchor is the same on every replica; a checkpoint should store it as it is.
      "anchors_saved_exactly": bool(last.get("anchor_digest")) and (
          last.get("anchor_held_digest") == last["anchor_digest"]),
      "anchors_restored": bool(last.get("anchor_digest")) and all(
          r.get("restored_anchor_digest") == last["anchor_digest"] for r in resumed),
      "outer_state_restored": bool(last.get("outer_digest")) and all(
          r.get("restored_outer_digest") == last["outer_digest"] for r in resumed),
      "restored_chief_weights": bool(last.get("weights_digest")) and all(
          r.get("restored_weights") == last["weights_digest"] for r in resumed),
      # Before the kill (the chief's record: it saw the last round end before it failed).
      "killed_round_ends": killed[0].get("round_ends"),
      "resumed_round_ends": resumed[0].get("round_ends"),
      "uninterrupted_round_ends": baseline.get("round_ends"),
      # With steps not a multiple of H the job stops mid-round: its workers' weights
      # differ then, by design (each holds its own until a round ends).
      "final_round_complete": steps % local_steps == 0,
  }
  # Each killed worker's rounds up to its last: every multiple of H, nothing else.
  killed_ok = all(r["round_ends"] == multiples(0, r["round_ends"][-1])
                  for r in killed if r.get("round_ends"))
  checks["rounds_aligned"] = bool(
      killed_ok and all(r.get("round_ends") == multiples(expected, steps) for r in resumed)
      and (not baseline or baseline.get("round_ends") ==
           multiples(0, baseline.get("steps") or 0)))
  checks["rounds_ok"] = bool(
      checks["planned_backup"] == expected and checks["backup_mid_round"]
      and checks["kill_mid_round"] and checks["anchors_saved_exactly"]
      and checks["anchors_restored"]
      and checks["outer_state_restored"] and checks["restored_chief_weights"]
      and checks["rounds_aligned"] and checks["final_round_complete"])
  return checks


def _plan(name, args):
  """``(local_steps, outer_optimizer, save_freq, planned)`` of scenario ``name``;
  ``planned`` is the local_steps scenario's ``(backup step, kill step)``, else None.
  Raises SystemExit where the local_steps scenario cannot run as asked."""
  local_steps, outer = _rounds(name, args)
  save_freq = _save_freq(name, args, local_steps)
  planned = _mid_round_kill(args, local_steps, save_freq) if name == "local_steps" else None
  return local_steps, outer, save_freq, planned


def _rounds(name, args):
  """``(local_steps, outer_optimizer)`` of scenario ``name``: as given, else 1 and
  "average" (the library's defaults), and for the local_steps scenario 4 and nesterov."""
  local_steps = args.local_steps or (LOCAL_STEPS_DEFAULT if name == "local_steps" else 1)
  outer = args.outer_optimizer or (OUTER_DEFAULT if name == "local_steps" else "average")
  if name == "local_steps" and local_steps < 2:
    raise SystemExit(f"The local_steps scenario needs rounds of at least 2 steps (a kill "
                     f"inside one). Received: --local_steps={local_steps}")
  return local_steps, outer


def _save_freq(name, args, local_steps):
  """The scenario's steps between backups: ``--save_freq``, but for the local_steps
  scenario one fewer where it is a multiple of H (every backup would end a round)."""
  if name == "local_steps" and args.save_freq % local_steps == 0:
    return args.save_freq - 1
  return args.save_freq


def _resumed_steps(backup_step, args):
  """Steps a job resumed from the backup after ``backup_step`` takes in all."""
  return backup_step + (args.epochs - _epoch_of(backup_step, args)) * args.steps_per_epoch


def _mid_round_kill(args, local_steps, save_freq):
  """``(backup step, kill step)``: a backup that falls mid-round and the first step after
  it that is mid-round and before the next backup; of those, the first from which the
  resumed job ends at a round's end, else the first."""
  total = args.epochs * args.steps_per_epoch
  found = []
  for backup in range(save_freq, total, save_freq):
    kills = [k for k in range(backup + 1, min(backup + save_freq, total))
             if k % local_steps]
    if backup % local_steps and kills:
      found.append((backup, kills[0]))
  if not found:
    raise SystemExit(
        f"The local_steps scenario needs a backup inside a round followed by a step inside "
        f"a round before the next backup; none in {total} steps. Received: "
        f"--local_steps={local_steps}, --save_freq={args.save_freq} (backups every "
        f"{save_freq}), --epochs={args.epochs}, --steps_per_epoch={args.steps_per_epoch}")
  complete = [f for f in found if _resumed_steps(f[0], args) % local_steps == 0]
  return (complete or found)[0]


def _epoch_of(step, args):
  """The epoch a job resumes at from a backup taken after ``step`` steps (save_freq
  batches apart; a backup at an epoch's last batch is that epoch's end)."""
  return step // args.steps_per_epoch


def _common(args, backup, local_steps, outer, save_freq):
  return ["--model", args.model, "--data", args.data, "--epochs", str(args.epochs),
          "--steps_per_epoch", str(args.steps_per_epoch), "--save_freq", str(save_freq),
          "--collective_timeout", str(args.collective_timeout), "--backup_dir", backup,
          "--local_steps", str(local_steps), "--outer_optimizer", outer]


def soak(args, work):
  local_steps, outer = _rounds("soak", args)
  records = run_job(["--replicas", "4", "--model", "cnn", "--data", args.data,
                     "--local_steps", str(local_steps), "--outer_optimizer", outer,
                     "--epochs", "1", "--steps_per_epoch", str(args.soak_steps),
                     "--save_freq", str(max(args.soak_steps // 4, 1)),
                     "--record_every", str(args.record_every),
                     "--backup_dir", os.path.join(work, "soak", "backup")],
                    1, os.path.join(work, "soak"), args.timeout)
  record = records[0]
  points = record.get("records", [])
  norms = [p["residue_norm"] for p in points]
  memory = [p["rss_mib"] for p in points]
  half = len(memory) // 2
  return {
      "steps": record.get("steps"), "returncode": record["returncode"],
      "replicas": record.get("replicas"),
      "residue_norm_max": max(norms) if norms else None,
      "residue_norm_last": norms[-1] if norms else None,
      "residue_norm_max_first_half": max(norms[:half]) if half else None,
      "residue_norm_max_second_half": max(norms[half:]) if half else None,
      "rss_mib_first": memory[0] if memory else None,
      "rss_mib_last": memory[-1] if memory else None,
      "rss_mib_max_first_half": max(memory[:half]) if half else None,
      "rss_mib_max_second_half": max(memory[half:]) if half else None,
      "replicas_identical_every_record": all(p["replicas_identical"] for p in points),
      "replicas_identical_at_end": record.get("replicas_identical"),
      "accuracy": record.get("accuracy"), "points": points,
      "error": record.get("error"),
  }


def main(argv=None):
  args = parse(argv)
  work = tempfile.mkdtemp(prefix="faults-")
  result = {"host": platform.node(), "cpus": os.cpu_count(), "args": vars(args)}
  try:
    if args.soak_steps:
      result["soak"] = soak(args, work)
      s = result["soak"]
      print(f"soak: {s['steps']} steps on {s['replicas']} replicas; residue norm max "
            f"{s['residue_norm_max']} (first half {s['residue_norm_max_first_half']}, second "
            f"half {s['residue_norm_max_second_half']}); RSS {s['rss_mib_first']} -> "
            f"{s['rss_mib_last']} MiB (max first half {s['rss_mib_max_first_half']}, second "
            f"half {s['rss_mib_max_second_half']}); replicas identical at every record: "
            f"{s['replicas_identical_every_record']}; test accuracy {s['accuracy']}")
    else:
      names = [n for n in args.scenarios.split(",") if n]
      unknown = [n for n in names if n not in SCENARIOS]
      if unknown:
        raise SystemExit(f"Unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
      for name in names:  # before any run: a scenario that cannot run says so now
        _plan(name, args)
      # One uninterrupted run per setting of the rounds (backups change nothing).
      baselines = {}
      for name in names:
        rounds = _rounds(name, args)
        if rounds not in baselines:
          folder = os.path.join(work, "baseline-{}-{}".format(*rounds))
          baselines[rounds] = {} if args.no_baseline else run_job(
              _common(args, os.path.join(folder, "backup"), *rounds, args.save_freq),
              args.workers, folder, args.timeout)[0]
      result["baselines"] = [
          {"local_steps": h, "outer_optimizer": outer,
           **{k: b.get(k) for k in ("steps", "accuracy", "returncode", "round_ends")}}
          for (h, outer), b in baselines.items()]
      result["baseline"] = result["baselines"][0]  # the first scenario's, as before
      rows = [scenario(name, args, work, baselines[_rounds(name, args)]) for name in names]
      result["scenarios"] = rows
      for b in result["baselines"]:
        print(f"uninterrupted (local_steps {b['local_steps']}, outer {b['outer_optimizer']}):"
              f" {b['steps']} steps, test accuracy {b['accuracy']}")
      print("scenario       killed  survivor fails   resumed at (backup)  residues  "
            "weights  steps (expected)  accuracy  ok")
      for r in rows:
        fail = (f"{r['seconds_to_fail']:.1f} s" if r["seconds_to_fail"] is not None
                else "-")
        print(f"{r['scenario']:<14} w{r['killed_worker']:<6} {fail:<16} "
              f"{str(r['resumed_at']):<10} ({r['expected_resume']:<3})        "
              f"{str(r['residues_restored']):<9} {str(r['final_weights_identical']):<8} "
              f"{r['steps']} ({r['steps_expected']})          {r['accuracy']}  {r['ok']}")
        if r["scenario"] == "local_steps":
          print(f"  local_steps {r['local_steps']}, outer {r['outer_optimizer']}, backups "
                f"every {r['save_freq']}: backup at {r['expected_resume']} mid-round "
                f"{r['backup_mid_round']}, kill at {r['killed_at_step']} mid-round "
                f"{r['kill_mid_round']}; anchors saved exactly "
                f"{r['anchors_saved_exactly']}, restored {r['anchors_restored']}, outer "
                f"state {r['outer_state_restored']}, chief's weights "
                f"{r['restored_chief_weights']}; rounds aligned {r['rounds_aligned']} "
                f"(ends before the kill {r['killed_round_ends']}, after the resume "
                f"{r['resumed_round_ends']}, uninterrupted {r['uninterrupted_round_ends']})"
                f"; final round complete {r['final_round_complete']}")
    if args.json:
      with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)
    else:
      print(f"work folder: {work}")
  return result


if __name__ == "__main__":
  main()
