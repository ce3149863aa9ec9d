"""One rank of the real backend: builds its model and runs the training steps.

With the whole transformer (``transformer.enabled``) each MoE layer is preceded by its
block of attention and dense layers (``real.rank.dense_model``: stage ``dense``, backward
``dense_backward``), the first layer by the embedding and the last followed by the
output head and its cross entropy, which replace the MoE stack's MSE loss; the optimizer
is then Adam (``real.kernels.adam``) unless ``transformer.optimizer = sgd``. With pipeline stages
(``parallelism.pp_size``) the rank runs its stage's scenario and its activations and
their gradients pass between the stages (``real.comm.stage_link``), micro-batch by
micro-batch (``transformer.micro_batches`` m): the step's tokens split into m runs of
whole sequences, each stage runs their forwards and backwards in Megatron-LM's
non-interleaved 1F1B order (``testbed.policy.pipeline_order``: p - s - 1 warm-up
forwards on stage s, then one forward and one backward, then the backwards left), the
gradients of the m backwards add up (each micro-batch's mean loss over the ranks and m,
so that they sum to the gradient of the step's mean), and the gradient sync, the
optimizer, the heat update and the page moves run once, after the last backward (with
``overlap.sync_with_backward``, the sync is issued from the last micro-batch's backward,
as Megatron-LM overlaps it). The controller decides each micro-batch's layers and sees
the step's routing as the micro-batches' combined (``testbed.policy.controller``): the
expert sync, the heat and the routing trace hold their counts summed.

Per step: every layer forward (``LayerRunner``), the loss (MSE to the task's targets
plus the aux loss) and its backward, the active-group discovery (M10: an all-gather of
every rank's bitmask of the experts it kept tokens for, all layers at once, which tells
the controller what every EP group used) and beside it, with bias balancing and several
replicas, the all-reduce of the routed counts over each replica group (the whole batch's
load the one balancing bias moves by, ``Planner.balance_ops``), the expert-gradient sync the controller
planned (all-reduce or two-stage with cached groups, M8-M10), the router-gradient
all-reduces (one per DDP-style bucket, after the backward), plain SGD on router and
experts (expert pages updated wherever they live), and the heat update with its page
moves. Every step starts at the control plane's gate and
ends by publishing the rank's metrics to it (``real.comm.control``: the launcher, or rank 0
under torchrun, merges them into a ``StepRecord`` that is streamed into the run folder).

Around the steps: a resumed run first restores the latest complete checkpoint and
starts from its step; after each step the due checkpoints are written (M23, in the
background); with ``real.profile`` the steps after warm-up run under ``torch.profiler``
and each rank writes ``torch_trace_rank<r>.json`` into the run folder. With
``heat.compute_source = "measured"`` compute heat is the expert kernel seconds of every
replica, else the kept slots of every rank; at each heat update those of the steps since
the last one are summed over ranks (the planner's ``heat_ops``, one all-reduce in the
``heat`` stage) so that every rank's controller is told the same (M18); with one replica
and kept slots the route all-gather already told every rank. Each rank keeps its own routed counts; the run's routing trace is gathered
from every rank when the run ends (the testbed's bookkeeping, not training traffic). With m > 1
micro-batches it holds each micro-batch's counts too (``micro_routed``, testbed.run.routing_trace),
which the simulator replays micro-batch by micro-batch on each pipeline rank.

The rank's state (weights, pager, groups, collectives) is a ``RankState``.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from real.comm.control import lead_fields
from real.comm.gradient_sync import GradientSync
from real.comm.stage_link import StageLink
from real.kernels.task import SyntheticTask, TokenTask
from real.rank.checkpoint import Checkpointer, checkpoint_dir
from real.rank.clock import mark
from real.rank.layer import LayerRunner, own_op
from real.rank.memory_meter import ActivationMeter, gradient_bytes, memory_breakdown
from real.rank.mtp import MTP_LOSS_WEIGHT
from real.rank.probe import probe_answers
from real.rank.rank_state import RankState
from testbed.core.errors import RunError, ScenarioError
from testbed.model.mtp_layers import controller_scenario, mtp_modules
from testbed.policy.pipeline_order import schedule_order
from testbed.policy.pipeline_stages import stage_place, stage_scenario
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario


class RankRunner:
    """The training loop of one rank."""

    def __init__(self, scenario: Scenario, rank: int, device: torch.device):
        # pipeline parallelism (testbed.policy.pipeline_stages): this rank runs its stage's scenario
        self.place = stage_place(scenario, rank) if scenario.parallelism.pp_size > 1 else None
        self.global_rank = rank  # the process group's; pipeline stages number their own ranks from 0
        #: the step's micro-batches (transformer.micro_batches, pipeline stages only: real.backend) and this
        #: rank's order of their forwards and backwards, Megatron's 1F1B (F0 B0 with one)
        self.micro_batches, self.order = 1, [("F", 0), ("B", 0)]
        step_tokens = scenario.workload.tokens_per_rank  # each rank's tokens a step, every micro-batch's
        if self.place is not None:
            self.micro_batches = scenario.transformer.micro_batches
            self.order = [(kind, i) for kind, _, i in schedule_order(self.place.stages, self.micro_batches, 1,
                                                                     self.place.stage)]
            scenario, rank = stage_scenario(scenario), self.place.local_rank  # one micro-batch's tokens
        model = scenario
        #: the model's MoE layers, then one per MTP module (real.rank.mtp): ``s`` is the controller's scenario
        self.main_layers, self.mtp = model.model.num_layers, mtp_modules(model)
        scenario = controller_scenario(model)
        self.s = scenario
        self.st = RankState(scenario, rank, device, place=self.place, model=model if self.mtp else None)
        self.pipe = StageLink(self.place, self.st) if self.place is not None else None
        self.layers = LayerRunner(self.st)
        # pipeline stages: each rank of a stage is one data-parallel stream of the whole model's, a step's
        # tokens split into the micro-batches (``step``)
        data = model if self.place is None else model.replace(model={"num_layers": self.place.layers},
                                                              workload={"tokens_per_rank": step_tokens})
        self.task = TokenTask(data) if scenario.transformer.enabled else SyntheticTask(data)
        self.world = scenario.world_size
        self.routing: list[np.ndarray] = []  # this rank's routed counts [L, E] per step
        #: m > 1 micro-batches: this rank's routed counts of each [m, L, E] per step, for the routing
        #: trace's micro_routed (testbed.run.routing_trace); a resumed run has none of the steps before
        self.micro_routing: list[np.ndarray] = []
        self.fanouts: list[np.ndarray] = []  # deepep: this rank's fanout [L, P + A] per step
        self.trace: list[dict] = []
        self.communicator_bytes = load_profile(scenario.cluster.profile).collectives.communicator_MiB * 2**20

    def run(self, control, debug: dict | None = None, run_dir: str | None = None, resume=None) -> dict:
        """All steps (from the resume point on); each step's metrics go to ``control``
        (``real.comm.control``: the launcher or rank 0 merges them into a record).

        ``run_dir``: the run folder (checkpoints and profiler traces go there).
        ``resume``: None = a fresh run; True = from the latest checkpoint complete on
        every rank; an int = from the checkpoint at that step.
        ``debug`` (tests): ``fail_at`` = {"rank": r, "after_steps": n} makes rank r die
        abruptly once n steps are done; ``capture`` = True returns every rank's first-step
        outputs, synced expert gradients, router gradients (and every weight's besides
        the routed experts', by name: ``named_grads``) and updated weights, every step's
        outputs, and its final weights (``final_named`` by name); ``blocked_pages`` = True computes every
        paged expert page by page (M14) even when none of its pages is in flight;
        ``grouped_kernel`` = True runs the grouped expert GEMM where it would not (CPU).
        """
        debug = debug or {}
        fail_at = debug.get("fail_at")
        self.capture = {} if debug.get("capture") else None
        self.st.force_blocks = bool(debug.get("blocked_pages"))
        if debug.get("grouped_kernel"):  # tests: the grouped GEMM on CPU too (torch's fallback)
            self.st.grouped = True
        s, st = self.s, self.st
        ckpt = None
        if s.checkpoint.enabled:
            ckpt = Checkpointer(s, self.global_rank, checkpoint_dir(s, run_dir))  # a folder per global rank
        first = 0
        if resume is not None and resume is not False:
            if ckpt is None:
                raise ScenarioError("checkpoint.enabled", False, "resuming needs the run's checkpoints")
            first = ckpt.resume_point(None if resume is True else int(resume))
            self.routing = ckpt.restore(first, st)  # the rank's routing of steps 0 .. first-1
        self.first_step = first
        profiler = _Profiler(s, st, run_dir)
        for step in range(first, s.run.steps):
            profiler.before(step)
            with profiler.step(step):
                self.step(step, control)
            if ckpt is not None:
                ckpt.after_step(step + 1, st, self.routing[-1])
            if fail_at and fail_at["rank"] == self.global_rank and step + 1 >= fail_at["after_steps"]:
                os._exit(9)
        control.finish()
        profiler.finish()
        if ckpt is not None:
            ckpt.close()  # every queued write on disk before the rank reports success
        return self._finish()

    def step(self, step: int, control) -> None:
        s, st = self.s, self.st
        st.begin_step(step)
        self.discovery_s = None
        if self.capture is not None and st.controller.balance is not None:  # tests: the bias the step routes with
            self.capture.setdefault("balance_bias", []).append(st.controller.balance.bias.copy())
        x_TH, y_TH = (t.to(st.device) for t in self.task.batch(step, st.rank))
        # every rank starts the timed step together: the testbed's own metrics exchange at
        # the end of the previous step is not training work, and without this the other
        # ranks would wait for it inside the next step's stages
        control.gate(step)
        t_start = st.clock.now()
        pipe = self.pipe  # pipeline stages: the activations come from the stage before
        if pipe is not None:
            pipe.sent_bytes = 0
        # the heat all-reduce and the M20 probe, for heat updates at this step's end or,
        # deferred (M18), at its first layer
        st.controller.set_heat_io(self._in_heat_stage(self._sum_heat),
                                  self._in_heat_stage(lambda instances: probe_answers(st, st.controller.step, instances)))
        # the micro-batches: consecutive whole sequences of the step's tokens (testbed.scenario checks the split)
        m = self.micro_batches
        xs, ys = x_TH.chunk(m), y_TH.chunk(m)
        micro: list[_MicroBatch | None] = [None] * m
        held = peak_held = 0  # bytes autograd saved for the backwards not yet run: 1F1B's in-flight activations
        during = s.overlap.sync_with_backward  # M22: issued from the (last micro-batch's) backward as gradients complete
        sync = None
        for kind, i in self.order:
            if self.capture is not None and step == 0:  # tests: the order the rank ran its micro-batches in
                self.capture.setdefault("order", []).append(f"{kind}{i}")
            if kind == "F":
                micro[i] = mb = self._forward(step, i, xs[i], ys[i])
                held += mb.activation_bytes
                peak_held = max(peak_held, held)
                if i == m - 1:  # the expert weights on the device once every forward ran
                    resident = (st.store.device_bytes if st.store
                                else sum(t.numel() * t.element_size() for t in st.unpaged.values()))
                continue
            mb = micro[i]
            if during and i == m - 1:  # every forward has run: the step's routing is known
                sync = GradientSync(self, sum(x.kept for x in micro), during_backward=True)
            st.clock.switch(mb.first_backward)
            self._backward(mb, i)
            held -= mb.activation_bytes
            micro[i] = mb.done()
        if pipe is not None:
            pipe.finish()
        routed, kept = sum(mb.routed for mb in micro), sum(mb.kept for mb in micro)  # [L, E]: the step's, combined
        first = micro[0].first  # layer 0's plan of the first micro-batch: a deferred heat update (M18) is applied there
        aux_total = sum(float(mb.aux) for mb in micro) / m
        losses = [float(mb.task_loss) for mb in micro if mb.task_loss is not None]
        mtp = [mb.mtp_loss for mb in micro if mb.mtp_loss is not None]
        if self.capture is not None:
            out = torch.cat([mb.output for mb in micro])  # the step's [T, H]: the micro-batches' in order
            self.capture.setdefault("outputs", []).append(out)
            self.capture.setdefault("micro_routed", []).append(np.stack([mb.routed for mb in micro]))  # [m, L, E]
            if step == 0:
                self.capture["output"] = out
        if during:
            self.sync_plan = sync.finish()
        else:
            sync = GradientSync(self, kept, during_backward=False)
            self.sync_plan = sync.after_backward()
        self.synced = sync.synced
        cache = self.sync_plan.cache
        if self.capture is not None and step == 0:
            updated = {int(i) for i in self.sync_plan.updated[st.rank]}  # a replica not synced goes stale
            self.capture["expert_grads"] = {int(i): self.synced.get(int(i), self._grad(int(i))).clone()
                                            for i in st.controller.local_instances(st.rank) if int(i) in updated}
            self.capture["router_grads"] = [(w.grad.clone(), b.grad.clone()) for w, b in st.router]
            # every weight besides routed experts by name (routers, shared experts, dense weights), summed
            self.capture["named_grads"] = {k: p.grad.detach().cpu().clone() for k, p in st.named_params().items()}
        held_grads = gradient_bytes(st)  # every gradient is in, until the optimizer step
        self._optimize()
        if self.capture is not None and step == 0:
            g = st.layout.group_of[st.rank]
            self.capture["experts_after"] = {int(i): st.read_weights(int(i)) for i in st.controller.local_instances(st.rank)
                                             if st.controller.fresh[int(i), g]}
        st.clock.switch("heat")
        end = st.controller.end_step(self._local_heat(kept))
        st.clock.switch("paging")
        st.execute_moves(end.page_moves.get(st.rank))
        st.settle_pages()
        self._check_weights()
        st.clock.switch(None)
        step_time = st.clock.now() - t_start
        memory = memory_breakdown(st, resident, peak_held, held_grads, self.communicator_bytes)
        grad_bytes = memory["gradients"]
        # CUDA: the caching allocator's peak, which leaves out what NCCL allocates itself
        # (its communicators' buffers and channels, cudaMalloc'd outside torch), while the
        # simulator's peak counts comm buffers and communicators (CUDA_PEAK_LEAVES_OUT)
        peak = (torch.cuda.max_memory_allocated(st.device) if st.device.type == "cuda"
                else resident + peak_held + grad_bytes + (memory["parameters"] + memory["optimizer_state"]
                                                          if st.dense is not None else 0))
        st.last_other_bytes = float(peak_held + grad_bytes)
        totals, regions = st.clock.take()
        heat = end.heat if end.heat is not None else (first.heat if first is not None else None)
        frozen = end.frozen if end.frozen is not None else (first.frozen if first is not None else None)
        local = {
            "step_time_s": step_time, "stage_time_s": totals, "by_stage": st.ledger.by_stage,
            "by_level": st.ledger.level_dict(), "peak": int(peak), "page_moves": st.page_moves,
            "moves_by_reason": dict(st.moves_by_reason),
            "frozen": None if frozen is None else frozen.get(st.rank, 0),
            "local_experts": len(st.controller.local_instances(st.rank)),
            "page_bytes": int(st.ledger.by_level[3]), "stall_s": st.stall_s,
            # the step's mean over its tokens: the micro-batches' means averaged (they hold as many tokens each)
            "loss": sum(losses) / m if losses else None, "aux": aux_total,
            "routed": int(routed.sum()), "dropped": int(routed.sum() - kept.sum()),
            "discovery_s": self.discovery_s, "memory": memory,
            "pipeline_sent_bytes": self.pipe.sent_bytes if self.pipe is not None else 0,
            "mtp_loss": sum(mtp) / m if mtp else None,  # the mean of the MTP modules' cross entropies
        }
        for name, t0, t1 in regions:
            self.trace.append({"name": name, "ph": "X", "pid": self.global_rank, "tid": stream_of(name),
                               "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6, "args": {"step": step}})
        self.routing.append(routed)
        if m > 1:
            self.micro_routing.append(np.stack([mb.routed for mb in micro]))  # [m, L, E]
        if micro[0].fanout is not None:  # deepep: what each layer's dispatches shared, for the routing trace
            self.fanouts.append(sum(mb.fanout for mb in micro))
        states = heat.state_counts() if heat is not None else None
        control.publish(step, local, lead_fields(cache, states))

    def _forward(self, step: int, i: int, x_TH: torch.Tensor, y_TH: torch.Tensor) -> _MicroBatch:
        """Micro-batch ``i``'s forward through this rank's layers: from the stage before (or the
        embedding, or the MoE stack's input), every layer (``LayerRunner``), then on to the
        next stage, or the output head and the loss."""
        s, st = self.s, self.st
        dense = st.dense  # the whole transformer's (issue 13): embedding, blocks, head
        pipe = self.pipe
        if pipe is not None and not pipe.first:
            h = pipe.receive_activations(x_TH.shape[0], s.model.hidden_size, i)
        elif dense is not None:
            st.clock.switch("dense")
            h = dense.embed(x_TH, y_TH)
        else:
            # the first MoE layer's input stands for the output of earlier layers: it needs a
            # gradient, so the first layer's dispatch backward runs like every other's
            h = x_TH.to(st.dtype).requires_grad_()
        aux_total = torch.zeros((), device=st.device)
        routed, kept = [], []  # this rank's counts per layer
        first = None  # layer 0's plan
        mtp_out = []  # each MTP module's output (real.rank.mtp): MoE layers main_layers + d
        h_main, mtp_total = None, 0.0  # the main model's output; the MTP modules' mean cross entropy
        with ActivationMeter(exclude=st.dense_params()) as meter:
            for layer in range(s.model.num_layers):
                if layer >= self.main_layers:  # MTP module d: the hidden state and the embedding of a token ahead
                    st.clock.switch("dense")
                    h_main = h if layer == self.main_layers else h_main
                    h = mark(dense.mtp_block(layer - self.main_layers, h, x_TH), st.clock, "dense_backward")
                elif dense is not None:  # the layer's attention and the dense layers before it
                    st.clock.switch("dense")
                    h = mark(dense.block(layer, h), st.clock, "dense_backward")
                h, aux, plan = self.layers.forward(layer, h, step, i)
                if layer >= self.main_layers:
                    mtp_out.append(h)
                first = plan if layer == 0 else first
                aux_total = aux_total + aux
                routed.append(plan.routed[st.rank])
                kept.append(plan.kept[st.rank])
        fanout = (np.stack([self.layers.fanout[layer] for layer in range(s.model.num_layers)])
                  if self.layers.fanout else None)
        h = h_main if self.mtp else h
        if pipe is not None and not pipe.last:  # on to the next stage; its gradient comes back
            pipe.send_activations(h, i)
            objective = task_loss = None
            first_backward = "combine_backward"
        elif dense is not None:  # the output head and the loss; their backward comes first
            st.clock.switch("dense")
            with meter:
                objective, task_loss = dense.loss(h, y_TH)
                for d, h_d in enumerate(mtp_out):  # lambda / D sum_k L_MTP^k (DeepSeek-V3 eq. 25)
                    mtp_loss = dense.mtp_loss(d, h_d, y_TH)
                    objective = objective + MTP_LOSS_WEIGHT / self.mtp * mtp_loss
                    mtp_total += float(mtp_loss.detach()) / self.mtp
            first_backward = "dense_backward"
        else:
            first_backward = "combine_backward"
            st.clock.switch(first_backward)
            task_loss = objective = torch.mean((h.float() - y_TH) ** 2)
        loss = aux_total if objective is None else objective + aux_total
        return _MicroBatch(h, loss, None if task_loss is None else task_loss.detach(),
                           aux_total.detach(), np.stack(routed), np.stack(kept), first,
                           mtp_total if mtp_out else None, meter.peak_bytes, first_backward, fanout,
                           h.detach().clone() if self.capture is not None else None)

    def _backward(self, mb: _MicroBatch, i: int) -> None:
        """Micro-batch ``i``'s backward from its loss (over the ranks that share the step's
        tokens, and its micro-batches: their gradients add up to the gradient of the step's
        mean loss, each micro-batch's mean over as many tokens). Pipeline stages: a stage
        before the last also starts from its output's gradient, received from the next
        stage, and a stage after the first sends its input's gradient back."""
        pipe, scaled = self.pipe, mb.loss / (self.world * self.micro_batches)
        if pipe is not None and not pipe.last:
            grad = pipe.receive_gradient(mb.out, i)
            self.st.clock.switch("combine_backward")
            torch.autograd.backward([mb.out, scaled], [grad, None])
        else:
            scaled.backward()
        if pipe is not None and not pipe.first:
            pipe.send_gradient(i)

    def _in_heat_stage(self, fn):
        """``fn`` timed as the heat stage, whichever stage the step is in when it runs (a
        deferred heat update runs inside the next step's first layer, M18)."""
        def run(*args):
            clock = self.st.clock
            before = clock.current
            clock.switch("heat")
            try:
                return fn(*args)
            finally:
                clock.switch(before)
        return run

    def _local_heat(self, kept_LE: np.ndarray) -> np.ndarray | None:
        """This rank's compute heat of the step per expert instance [L*E] (M18): its
        measured expert kernel seconds, or its kept slots; None when the controller needs
        neither (kept slots with one replica: it was told every rank's counts)."""
        st = self.st
        if st.timer is not None:
            if st.device.type == "cuda":
                torch.cuda.synchronize(st.device)
            seconds = np.zeros(self.s.model.num_layers * self.s.model.num_experts)
            for inst, sec in st.timer.collect().items():
                seconds[inst] += sec
            return seconds
        return kept_LE.reshape(-1).astype(np.float64) if st.planner.heat_ops() else None

    def _sum_heat(self, heat_SN: np.ndarray) -> np.ndarray:
        """The planner's heat all-reduce at a heat update: the compute heat of the steps
        since the last one [steps, L*E], summed over all ranks."""
        st = self.st
        buf = torch.from_numpy(np.ascontiguousarray(heat_SN, dtype=np.float64)).to(st.device)
        op = own_op(st.planner.heat_ops(len(heat_SN)), st.rank, buf)
        if op is None:  # one rank
            return heat_SN
        st.comm.all_reduce(buf, op.members, st.groups.get(op.members))
        return buf.cpu().numpy()

    def start_discovery(self, kept_LE: np.ndarray):
        """The step's active-group discovery (M10, ``Planner.discovery_ops``), issued now
        (stage expert_sync): every rank's bitmask of the experts it kept tokens for, all
        layers, gathered over all ranks. Returns a function that waits for it and gives
        which EP groups used each expert [L, R, E] (None with one replica: the route
        all-gather told every rank)."""
        st = self.st
        t0 = time.perf_counter()
        bits = torch.from_numpy(np.packbits(kept_LE.reshape(-1) > 0)).to(st.device)
        op = own_op(st.planner.discovery_ops(), st.rank, bits)
        if op is None:
            return lambda: None
        lay = st.layout
        got, work = st.comm.all_gather(bits, op.members, st.groups.get(op.members), async_op=True, stage="expert_sync")
        issued = time.perf_counter() - t0

        def answer():
            t1 = time.perf_counter()
            if work is not None:
                work.wait()
            used = np.unpackbits(got.view(len(op.members), -1).cpu().numpy(), axis=1, count=kept_LE.size)
            used = used.astype(bool).reshape((lay.world,) + kept_LE.shape)
            # its cost to this rank: issuing it and waiting for it (not the work done between)
            self.discovery_s = issued + time.perf_counter() - t1
            return used[lay.rank_of].any(axis=1).transpose(1, 0, 2)  # [R, P, L, E] -> [L, R, E]
        return answer

    def start_balance_sum(self):
        """Bias balancing with several replicas (``Planner.balance_ops``), issued now beside
        the discovery (stage expert_sync): the routed counts of this rank's EP group, every
        layer [L, E] int32 (``Controller.balance_counts``), summed over its replica group,
        which gives the whole batch's. Returns a function that waits for it and tells the
        controller (``Controller.tell_balance_load``); with one replica, or bias balancing
        off, there is nothing to do."""
        st = self.st
        ops = st.planner.balance_ops()
        if not ops:
            return lambda: None
        counts = torch.from_numpy(st.controller.balance_counts(st.rank)).to(st.device)  # NCCL: device tensors
        op = own_op(ops, st.rank, counts)
        work = st.comm.all_reduce(counts, op.members, st.groups.get(op.members), async_op=True, stage="expert_sync")

        def tell():
            if work is not None:
                work.wait()
            st.controller.tell_balance_load(counts.cpu().numpy())
        return tell

    # ---- after the backward ----------------------------------------------------------------------
    def _grad(self, instance: int) -> torch.Tensor:
        if instance in self.st.grads:
            return self.st.grads[instance]
        return torch.zeros(self.s.model.expert_params, dtype=self.st.dtype, device=self.st.device)

    def _optimize(self) -> None:
        """The optimizer step on the routers and dense weights (every rank) and the experts
        whose replica receives a gradient: plain SGD, or with the whole transformer's
        ``transformer.optimizer = adam`` mixed-precision Adam (``real.kernels.adam``)."""
        s, st = self.s, self.st
        st.clock.switch("optimizer")
        lr, adam = s.run.learning_rate, st.adam
        with torch.no_grad():
            for k, p in enumerate(st.dense_params()):
                if adam is not None:
                    p.copy_(adam.step(("dense", k), p.grad))
                else:
                    p -= lr * p.grad
                p.grad = None
            for inst in self.sync_plan.updated[st.rank]:
                inst = int(inst)
                g = self.synced.get(inst, self._grad(inst))
                new = adam.step(("expert", inst), g).to(st.dtype) if adam is not None else None
                if st.store is not None:
                    shipped = st.store.update(inst, g, lr) if new is None else st.store.write(inst, new)
                    st.ledger.add_pcie("paging", shipped)
                else:
                    st.set_unpaged(inst, st.unpaged[inst] - lr * g if new is None else new)
                if st.shadow is not None:
                    st.shadow[inst] = st.shadow[inst] - lr * g if new is None else new.clone()
        st.execute_moves(self.sync_plan.page_moves.get(st.rank))

    def _check_weights(self) -> None:
        st = self.st
        if st.shadow is None or st.store is None:
            return
        g = st.layout.group_of[st.rank]
        for inst, ref in st.shadow.items():
            if st.controller.fresh[inst, g] and not torch.equal(st.store.read(inst), ref):
                raise RunError(f"rank {st.rank}: paged weights of expert instance {inst} differ from the reference copy")

    def _finish(self) -> dict:
        st = self.st
        if self.capture is not None:
            g = st.layout.group_of[st.rank]
            self.capture["final_experts"] = {int(i): st.read_weights(int(i)).cpu()
                                             for i in st.controller.local_instances(st.rank)
                                             if st.controller.fresh[int(i), g]}
            self.capture["final_router"] = [(w.detach().cpu().clone(), b.detach().cpu().clone()) for w, b in st.router]
            self.capture["final_named"] = {k: p.detach().cpu().clone() for k, p in st.named_params().items()}
            self.capture["heat_states"] = st.controller.heat.states
            self.capture["blocked_experts"] = st.blocked_experts
            self.capture["weight_copy_bytes"] = st.weight_copy_bytes
            if st.store is not None:
                self.capture["page_reads"] = st.store.page_reads.copy()  # [local pages], pager numbering
        lead, world = dist.get_rank() == 0, dist.get_world_size()  # every rank of every pipeline stage
        events = [None] * world if lead else None
        dist.gather_object(self.trace, events, dst=0)
        routing = [None] * world if lead else None
        dist.gather_object(self.routing, routing, dst=0)
        fanouts = [None] * world if lead else None
        dist.gather_object(self.fanouts, fanouts, dst=0)
        # each micro-batch's routing when every step's is here (a resumed run's earlier steps are not)
        whole_micro = self.micro_batches > 1 and len(self.micro_routing) == len(self.routing)
        micro = [None] * world if lead else None
        dist.gather_object(self.micro_routing if whole_micro else [], micro, dst=0)
        captured = [None] * world if lead else None
        if self.capture is not None:
            dist.gather_object(self.capture, captured, dst=0)
        if not lead:
            return {}
        trace = [e for per_rank in events for e in per_rank]
        steps = len(self.routing)
        whole = self._whole_model(routing) if steps else None
        if steps and all(len(r) == steps for r in micro):  # [S, m, L, W, E]: RoutingTrace keeps the axis
            whole = np.moveaxis(self._whole_model([[x.swapaxes(0, 1) for x in r] for r in micro]), 3, 1)
        return {"trace": trace, "routing": whole,
                "fanout": self._whole_model(fanouts) if steps and fanouts[0] else None,
                "group_create_s": self.st.groups.created_s, "group_create_bytes": self.st.groups.created_bytes,
                "first_step": self.first_step,
                "captured": captured if self.capture is not None else None}

    def _whole_model(self, per_rank: list[list[np.ndarray]]) -> np.ndarray:
        """[S, L, W, ...] from every global rank's [L, ...] per step. Pipeline stages: each
        stage's ranks hold its layers, so the whole model's layers come stage after stage
        and W is a stage's ranks (its data-parallel streams): the trace of the one-stage run
        of the same tokens, its counts the step's micro-batches' summed."""
        if self.place is None:
            return np.stack([np.stack(r) for r in per_rank], axis=2)
        n = self.place.ranks
        stages = [np.stack([np.stack(r) for r in per_rank[k * n:(k + 1) * n]], axis=2)
                  for k in range(self.place.stages)]
        return np.concatenate(stages, axis=1)


@dataclass
class _MicroBatch:
    """One micro-batch's forward, kept for its backward and the step's record: its output
    ``out`` and ``loss`` (what the backward starts from), the task loss and the aux loss,
    this rank's routed and kept counts [L, E], layer 0's plan, the MTP modules' mean cross
    entropy, the bytes autograd saved for its backward, the stage its backward starts in,
    deepep's fanout [L, P + A], and (tests) a copy of the output."""

    out: torch.Tensor | None
    loss: torch.Tensor | None
    task_loss: torch.Tensor | None  # detached: read once the step is done (on CUDA reading waits for the device)
    aux: torch.Tensor
    routed: np.ndarray
    kept: np.ndarray
    first: object
    mtp_loss: float | None
    activation_bytes: int
    first_backward: str
    fanout: np.ndarray | None
    output: torch.Tensor | None = None

    def done(self) -> _MicroBatch:
        """Its backward has run: the tensors go (autograd freed what they held)."""
        self.out = self.loss = None
        return self


class _Profiler:
    """``torch.profiler`` over the steps after warm-up (``real.profile``); each rank
    writes ``torch_trace_rank<r>.json`` (Chrome trace) into the run folder."""

    def __init__(self, scenario: Scenario, state: RankState, run_dir: str | None):
        self.on = scenario.real.profile and run_dir is not None
        self.warmup = scenario.run.warmup_steps
        self.path = Path(run_dir) / f"torch_trace_rank{state.rank}.json" if run_dir is not None else None
        self.prof = None
        self.cuda = state.device.type == "cuda"

    def before(self, step: int) -> None:
        if self.on and self.prof is None and step >= self.warmup:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()

    def step(self, step: int):
        if self.prof is None:
            return nullcontext()
        return torch.profiler.record_function(f"step {step}")

    def finish(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.path))
            self.prof = None


def stream_of(stage: str) -> str:
    """The stream a stage's region is drawn on in the trace (compute, comm or copy)."""
    if stage in ("paging",):
        return "copy"
    if stage in ("experts", "experts_backward", "optimizer", "heat", "route", "route_backward", "dense",
                 "dense_backward"):
        return "compute"
    return "comm"
