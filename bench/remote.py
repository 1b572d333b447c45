"""Benchmark modes that go through the servers.

sd-remote, head-remote, head-tree-remote, ngram-remote, ssd, ssd-pull, ssd-shared: a speculation endpoint and a target service start as
separate processes (once per run), with mutual TLS between them and to the bench (a throwaway CA).
sd-remote-plaintext and ngram-remote-plaintext run the same on servers of their own started with
--insecure: what TLS costs, measured side by side. routed and routed-ar: a whole local cluster
(cluster/examples/smollm2.yaml or --cluster FILE: Redis, router, targets, endpoint) and requests through its router, with
speculation planned by the router (AUTO) or off (NONE, AR on the same servers). Each chunk of
prompts is sent as concurrent Generate calls through the Target API, and the wall time from the
first submit to the last answer is what the chunk costs, as for the in-process modes. routed-http:
routed's requests through the router's OpenAI-compatible HTTP front instead (POST /v1/completions,
streaming off, with the `openai` SDK), so what the front costs is routed-http against routed.
routed-ray and routed-ray-ar: the same cluster file's members as Ray actors (`specpool up --ray`,
cluster/ray_launcher.py) on the Ray cluster at --ray (unset: a one-node Ray on 127.0.0.1 that the
run starts and stops), so what launching on Ray costs is routed-ray against routed, in one run.
ar-remote: plain decoding (method NONE) through the sd-remote target, the reference sd-remote's speedup
is taken against when both run (the same process, gRPC and scheduler: the ratio is the speculation's).
sd-remote-x2 and ar-remote-x2: two targets of the model on the one shared endpoint, both active: each chunk
goes to both at once (the same prompts, a thread each), drafted through the endpoint or decoded plainly, so
a target's speedup beside another is sd-remote-x2's over ar-remote-x2's. Every remote mode also counts the
endpoint's draft forwards and the target tokens its sessions reported (its /metrics, before and after each
chunk): their ratio, draft forwards per target token, falls as the endpoint batches more targets' sequences.
"""

from __future__ import annotations

import logging
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specpool.bench.totals import ModeTotals
from specpool.cluster.config import SMOLLM2_CONFIG, ClusterConfig, EndpointSpec, TargetSpec
from specpool.cluster.launcher import Cluster, endpoint_command, target_command
from specpool.cluster.processes import ServerProcess, start_server
from specpool.common.security import CA_CERT, LocalCA, Security, server_name
from specpool.common.speculation import method_to_pb, sampling_to_pb
from specpool.engine.method import METHODS, Method
from specpool.engine.runtime.gguf_loader import default_model_path, model_name
from specpool.engine.verification.sampling import SamplingParams
from specpool_client import generate_result
from specpool_client.v1 import target_pb2 as pb
from specpool_client.v1 import target_pb2_grpc

log = logging.getLogger(__name__)

PLAINTEXT = "-plaintext"
X2 = "-x2"  # two targets on one endpoint, both sent each chunk
REMOTE_MODES = ("sd-remote", "head-remote", "head-tree-remote", "ngram-remote", "sd-remote" + PLAINTEXT,
                "ngram-remote" + PLAINTEXT, "ssd", "ssd-pull", "ssd-shared", "ar-remote", "sd-remote" + X2,
                "ar-remote" + X2)
TREE_MODES = ("head-tree-remote",)  # requests ask for token trees
ROUTED_METHODS = {"routed": None, "routed-ar": Method.NONE, "routed-http": None,  # None: the router plans (AUTO)
                  "routed-ray": None, "routed-ray-ar": Method.NONE}
RAY_NAMESPACE = "specpool-bench"
# SSD's layout, chosen on 2-core AVX-512 machines: drafting overlaps verification only when each has
# a core of its own. Recorded in every report that ran SSD.
SSD_ENDPOINT_CPUS, SSD_TARGET_CPUS = [1], [0]
SSD_LAYOUT = f"endpoint on cpus {SSD_ENDPOINT_CPUS}, targets on cpus {SSD_TARGET_CPUS}, 1 thread each"


def mode_method(mode: str) -> Method | None:
    """The method a bench mode measures, by its method row's bench modes (and their -remote, -plaintext,
    -pull and :K variants); None: a mode of no method (ar, the peers)."""
    family = mode.split(":")[0].removesuffix(X2).removesuffix(PLAINTEXT).removesuffix("-remote").removesuffix("-pull")
    return next((row.method for row in METHODS if family in row.bench_modes), None)


class RemoteCluster:
    """Servers for the remote modes, started on first use and stopped by close().

    sd-remote and ngram-remote use one endpoint and one target, unpinned with all cores' threads,
    like the in-process modes. SSD overlaps drafting with verification, so its endpoint and its
    targets (one in push mode, one in pull mode) are pinned to a core each, one thread apiece;
    ssd-shared runs SSD on the unpinned pair instead, each on every core while the other waits.
    """

    def __init__(self, model_path: Path, dtype: str, max_batch: int, draft_dir: Path | None,
                 datastore: Path | None, max_context: int = 2048, delay_ms: float = 0.0,
                 threads: int | None = None, endpoint_args: tuple[str, ...] = (), target_args: tuple[str, ...] = (),
                 head_dir: Path | None = None):
        drafter = f"{model_name(model_path)}={model_path}"
        if draft_dir:
            drafter += f",draft={draft_dir}"
        if head_dir:
            drafter += f",head={head_dir}"
        if datastore:
            drafter += f",datastore={datastore}"
        self.drafter, self.model_path, self.dtype = drafter, model_path, dtype
        self.max_batch, self.max_context, self.delay_ms = max_batch, max_context, delay_ms
        self.datastore = datastore
        self.threads = threads  # of the unpinned servers (None: torch's default, all cores)
        self.endpoint_args = list(endpoint_args)  # further serve-spec flags (e.g. --ssd-fork-budget 16)
        self.target_args = list(target_args)  # further serve-target flags (e.g. --spec-deadline-ms 2000)
        self.servers: list[ServerProcess] = []
        self.targets: dict[str, ServerProcess] = {}  # by kind (see _target)
        self._endpoints: dict[str, ServerProcess] = {}
        self.ca = LocalCA.temporary()
        self.credentials = self.ca.client("bench")

    def _endpoint(self, pinned: bool, plaintext: bool) -> ServerProcess:
        key = ("pinned" if pinned else "shared") + (PLAINTEXT if plaintext else "")
        if key not in self._endpoints:
            spec = EndpointSpec(name="", drafters=(self.drafter,), max_sessions=max(64, self.max_batch),
                                threads=self._threads(pinned),
                                args=("--max-len", str(self.max_context), "--ssd-sessions",
                                      str(max(16, self.max_batch)), *self.endpoint_args))
            self._endpoints[key] = self._start(f"spec-{key}", endpoint_command(spec),
                                               cpus=SSD_ENDPOINT_CPUS if pinned else None, plaintext=plaintext)
        return self._endpoints[key]

    def _target(self, mode: str, draft_tokens: int = 0, index: int = 0) -> tuple[str, ServerProcess]:
        """mode[:K] -> (its tenant, the target serving it), started on first use (a fixed draft length
        K gets a target of its own, as do the -x2 modes' pair, whose policies learn the slower rounds of two
        targets side by side; index > 0: another target of the same kind, a tenant of its own)."""
        pinned, plaintext = self._placement(mode)
        kind = {"ssd": "ssd-push", "ssd-pull": "ssd-pull", "ssd-shared": "ssd-shared"}.get(mode, "shared") + (
            PLAINTEXT if plaintext else "")
        if draft_tokens:
            kind += f"-k{draft_tokens}"
        if mode.endswith(X2):  # targets of their own: beside each other they learn slower steps than alone
            kind += X2
        if index:
            kind += f"-{index + 1}"
        if kind not in self.targets:
            endpoint = self._endpoint(pinned, plaintext)
            args = ["--spec-delay-ms", str(self.delay_ms), *self.target_args]
            if mode.startswith("ssd"):
                args += ["--ssd-mode", "pull" if mode == "ssd-pull" else "push"]
            if draft_tokens:
                args += ["--draft-tokens", str(draft_tokens)]
            spec = TargetSpec(tenant=f"bench-{kind}", model=str(self.model_path), max_batch=self.max_batch,
                              max_context=self.max_context, threads=self._threads(pinned),
                              layout_cores=len(SSD_ENDPOINT_CPUS + SSD_TARGET_CPUS) if pinned else None,
                              datastore=str(self.datastore or ""), dtype=self.dtype, args=tuple(args))
            self.targets[kind] = self._start(f"target-{kind}", target_command(spec, endpoint.address),
                                             cpus=SSD_TARGET_CPUS if pinned else None, plaintext=plaintext)
        return f"bench-{kind}", self.targets[kind]

    @staticmethod
    def _placement(mode: str) -> tuple[bool, bool]:
        """(pinned, plaintext): which endpoint and which kind of target a mode runs on."""
        return mode in ("ssd", "ssd-pull"), mode.endswith(PLAINTEXT)

    def _threads(self, pinned: bool) -> int | None:
        return 1 if pinned else self.threads

    def _start(self, name: str, args: list[str], cpus: list[int] | None, plaintext: bool) -> ServerProcess:
        server = start_server(name, args + ["--insecure"] if plaintext else args, cpus=cpus, env=self.ca.env)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    def runner(self, mode: str, max_tokens: int, draft_tokens: int = 0):
        """The mode's Runner; AR modes (ar-remote, ar-remote-x2) decode plainly on the targets of draft length
        `draft_tokens`, which leaves plain decoding alone."""
        method = Method.NONE if mode.startswith("ar-") else mode_method(mode)
        credentials = Security.insecure() if mode.endswith(PLAINTEXT) else self.credentials
        runs, targets = [], []
        for index in range(2 if mode.endswith(X2) else 1):
            tenant, target = self._target(mode, draft_tokens, index)
            stub = target_pb2_grpc.TargetServiceStub(credentials.channel(target.address, "target", tenant))
            runs.append(target_api_runner(stub, method, max_tokens, tree=mode in TREE_MODES))
            targets.append(target)
        return counting(runs[0] if len(runs) == 1 else all_at_once(runs), self._endpoint(*self._placement(mode)),
                        targets, method)


class RoutedCluster:
    """The cluster of the routed modes, started on first use and stopped by close()."""

    def __init__(self, model_path: Path, config_path: Path | None = None, ray_address: str | None = None):
        # The default cluster (cluster/default.yaml) serves two models: the routed modes' default is SmolLM2's.
        self.config = ClusterConfig.load(config_path or SMOLLM2_CONFIG).with_free_ports()
        self.ray_address = ray_address  # of the routed-ray modes (None: a one-node Ray of the run's own)
        self.ray_cluster = None
        self._own_ray = False
        models = {Path(t.model).resolve() if t.model else default_model_path().resolve() for t in self.config.targets}
        if models != {model_path.resolve()}:
            raise ValueError(f"routed modes: the cluster config serves {sorted(map(str, models))}, the bench measures "
                             f"{model_path}: pass --cluster with a config whose targets serve the bench's model")
        self.cluster: Cluster | None = None

    def runner(self, mode: str, max_tokens: int):
        if mode.startswith("routed-ray"):
            stub = target_pb2_grpc.TargetServiceStub(self._on_ray().router_channel("alpha"))
            return target_api_runner(stub, ROUTED_METHODS[mode], max_tokens)
        if self.cluster is None:
            self.cluster = Cluster.start(self.config, progress=lambda text: log.info("cluster: %s", text))
        if mode == "routed-http":
            ca = self.cluster.ca.dir / CA_CERT if self.cluster.ca is not None else None
            return openai_http_runner(self.cluster.http_url(), self.cluster.token("alpha"), ca, max_tokens)
        stub = target_pb2_grpc.TargetServiceStub(self.cluster.router_channel("alpha"))
        return target_api_runner(stub, ROUTED_METHODS[mode], max_tokens)

    def _on_ray(self):
        """The cluster as Ray actors, started on first use."""
        if self.ray_cluster is None:
            import ray

            from specpool.cluster.ray_launcher import RayCluster
            from specpool.cluster.ray_plan import ray_cpus_needed

            if self.ray_address is None and not ray.is_initialized():
                # Logical CPUs enough for the file's asks: the members' pins and threads decide the real ones.
                ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=ray_cpus_needed(self.config),
                         include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
                         namespace=RAY_NAMESPACE)
                self._own_ray = True
            self.ray_cluster = RayCluster.start(self.config, address=self.ray_address, namespace=RAY_NAMESPACE,
                                                progress=lambda text: log.info("ray cluster: %s", text))
        return self.ray_cluster

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.ray_cluster is not None:
            self.ray_cluster.down()
        if self._own_ray:
            import ray

            ray.shutdown()


def target_api_runner(stub: target_pb2_grpc.TargetServiceStub, method: Method | None, max_tokens: int,
                      tree: bool = False):
    """A bench Runner that sends each chunk as concurrent Generate calls to `stub`, each read to its end (the
    servers' own counts, the targets' verify time among them: `counting`)."""

    def run(prompts: list[list[int]], params: SamplingParams, totals) -> None:
        def one(ids: list[int]) -> pb.GenerateResult:
            return generate_result(stub, pb.GenerateRequest(
                prompt_ids=pb.TokenIds(ids=ids), max_tokens=max_tokens, sampling=sampling_to_pb(params),
                speculation=pb.SpeculationPreference(method=method_to_pb(method), tree=tree),
            ))

        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, prompts))
        totals.seconds += time.perf_counter() - start
        totals.target_steps = totals.target_steps or 0
        totals.fallback_rounds = totals.fallback_rounds or 0
        for r in results:
            c = r.completions[0]
            totals.new_tokens += len(c.token_ids)
            totals.first_tokens += 1
            totals.target_steps += c.speculation.target_steps
            totals.drafted += c.speculation.drafted_tokens
            totals.fallback_rounds += c.speculation.fallback_rounds
            totals.cache_hits += c.speculation.cache_hits
            totals.cache_lookups += c.speculation.cache_lookups
            totals.outputs.append(list(c.token_ids))

    return run


def all_at_once(runs):
    """A bench Runner that sends each chunk through every runner at once (a thread each, the same prompts): each
    one's totals in totals.targets, their sums in totals, and as its time the wall time from the first submit
    to the last answer."""

    def run(prompts: list[list[int]], params: SamplingParams, totals: ModeTotals) -> None:
        totals.targets = totals.targets or [ModeTotals() for _ in runs]
        start = time.perf_counter()
        with ThreadPoolExecutor(len(runs)) as pool:
            for done in [pool.submit(r, prompts, params, t) for r, t in zip(runs, totals.targets)]:
                done.result()
        totals.seconds += time.perf_counter() - start
        for name in ("new_tokens", "target_steps", "first_tokens", "drafted", "fallback_rounds", "cache_hits",
                     "cache_lookups"):
            setattr(totals, name, sum(getattr(t, name) or 0 for t in totals.targets))
        totals.outputs = [out for t in totals.targets for out in t.outputs]

    return run


# What a remote mode's servers count over its chunks, from their /metrics before and after each (modes run one at a
# time, so the chunk's alone): name -> (whose: the endpoint's or the targets' summed, sample).
SERVER_COUNTS = {
    "draft_forwards": ("endpoint", "specpool_spec_draft_forwards_total"),  # one serves every sequence it batches
    "endpoint_target_tokens": ("endpoint", "specpool_spec_target_tokens_total"),  # those its sessions reported
    "endpoint_draft_s": ("endpoint", "specpool_spec_draft_seconds_sum"),
    "rounds": ("targets", "specpool_target_round_seconds_count"),
    "round_s": ("targets", "specpool_target_round_seconds_sum"),
    "verify_s": ("targets", "specpool_target_verify_seconds_sum"),
    "draft_wait_s": ("targets", "specpool_target_spec_round_seconds_sum"),
    "wire_s": ("targets", "specpool_target_spec_wire_seconds_sum"),
}


def counting(run, endpoint: ServerProcess, targets: list[ServerProcess], method: Method | None):
    """`run`, also summing SERVER_COUNTS over its chunks into totals.server_counts and keeping, after each chunk,
    the speedup the targets' policies predict for `method` (their heartbeat's gauge) and the threads the endpoint
    drafts on (its own gauge): what capacity planning reads."""

    def counts() -> dict[str, float]:
        servers = {"endpoint": [endpoint], "targets": targets}
        return {name: sum(s.metric_total(sample) for s in servers[whose])
                for name, (whose, sample) in SERVER_COUNTS.items()}

    def counted(prompts: list[list[int]], params: SamplingParams, totals: ModeTotals) -> None:
        before = counts()
        run(prompts, params, totals)
        totals.server_counts.update({name: n - before[name] for name, n in counts().items()})
        totals.drafter_threads = int(endpoint.metric_total("specpool_spec_draft_threads"))
        if method not in (None, Method.NONE):
            predicted = [t.metric_total("specpool_target_predicted_speedup", method=method.value) for t in targets]
            if all(predicted):  # 0: no heartbeat has set it yet
                totals.predicted_speedups.append(sum(predicted) / len(predicted))

    return counted


def openai_http_runner(base_url: str, token: str | None, ca_file: Path | None, max_tokens: int):
    """A bench Runner that sends each chunk as concurrent POST /v1/completions (streaming off) to a
    router's OpenAI-compatible front with the `openai` SDK: the prompt as token ids, speculation left
    to the router (AUTO), token ids back (return_token_ids) to compare with AR."""
    import openai  # the test extra's, as transformers is for the hf modes

    def router_name(request) -> None:  # the router's certificate names router.specpool, not an address
        request.extensions["sni_hostname"] = server_name("router")

    http = openai.DefaultHttpxClient(
        verify=ssl.create_default_context(cafile=str(ca_file)) if ca_file else True,
        event_hooks={"request": [router_name]} if ca_file else None, timeout=None)
    client = openai.OpenAI(base_url=base_url, api_key=token or "none", http_client=http, max_retries=0)

    def run(prompts: list[list[int]], params: SamplingParams, totals) -> None:
        if params.top_k:
            raise ValueError("routed-http: OpenAI's API has no top_k")

        def one(ids: list[int]):
            return client.completions.create(
                model="", prompt=ids, max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p,
                seed=params.seed, extra_body={"return_token_ids": True}).choices[0].model_extra

        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            choices = list(pool.map(one, prompts))
        totals.seconds += time.perf_counter() - start
        totals.target_steps = totals.target_steps or 0
        totals.fallback_rounds = totals.fallback_rounds or 0
        for c in choices:
            stats = c["speculation"]
            totals.new_tokens += len(c["token_ids"])
            totals.first_tokens += 1
            totals.target_steps += stats["target_steps"]
            totals.drafted += stats["drafted_tokens"]
            totals.fallback_rounds += stats["fallback_rounds"]
            totals.cache_hits += stats["cache_hits"]
            totals.cache_lookups += stats["cache_lookups"]
            totals.outputs.append(list(c["token_ids"]))

    return run
