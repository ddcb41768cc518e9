"""kvgate-fleet.json: fronts over replicas. The fronts (job and instance) with their traffic, each upstream's
load, answers and errors, and why requests went where they went; the replicas that are kvgate runtimes
(replica_job), scraped on their own or carried by a front of `--workers` (each sample labelled `worker`)."""

from __future__ import annotations

from typing import Any

from grafana import dashboard, panel, quantiles, rate, share, variable

FRONT = 'job=~"$job", instance=~"$instance", worker=""'  # a front's own samples, not its workers'
GENERATING = f'{FRONT}, route=~"/v1/(chat/completions|completions|responses|messages)"'
REPLICA = 'job=~"$replica_job", instance=~"$replica_instance"'
EACH = "instance, worker"  # a replica: its own instance, or a front's worker
TOKENS = "suffix: tok/s"
ENGINES = f"sum by ({EACH}) (kvgate_requests_running{{{REPLICA}}})"  # one series per process with an engine


def fronts() -> list[dict[str, Any]]:
    requests = "kvgate_requests_total"
    return [
        panel(
            "Requests by front",
            "HTTP requests per second at each front.",
            "reqps",
            [(rate(requests, FRONT, "instance"), "{{instance}}")],
        ),
        panel(
            "Errors at the fronts",
            "Answers with a 4xx or 5xx status per second, by status: 429 and 503 are the fronts' limits and "
            "queues, 502 and 504 no upstream answering.",
            "reqps",
            [(rate(requests, f'{FRONT}, status=~"[45].."', "status"), "{{status}}")],
        ),
        panel(
            "Tokens through the fronts",
            "Prompt and completion tokens per second, by model (from the upstreams' usage).",
            TOKENS,
            [
                (rate("kvgate_prompt_tokens_total", FRONT, "model"), "prompt {{model}}"),
                (rate("kvgate_completion_tokens_total", FRONT, "model"), "completion {{model}}"),
            ],
        ),
        panel(
            "End-to-end latency at the fronts",
            "Request to last byte on the generating routes, as clients see it.",
            "s",
            quantiles("kvgate_request_duration_seconds", GENERATING),
            width=12,
        ),
        panel(
            "Time to first token at the fronts",
            "Streamed responses: request to the first event.",
            "s",
            quantiles("kvgate_time_to_first_token_seconds", FRONT),
            width=12,
        ),
    ]


def upstreams() -> list[dict[str, Any]]:
    decisions = "kvgate_routing_decisions_total"
    return [
        panel(
            "Answers by upstream",
            "Answers each upstream gave that the fronts passed on, per second, by status.",
            "reqps",
            [(rate("kvgate_upstream_responses_total", FRONT, "upstream, status"), "{{upstream}} {{status}}")],
        ),
        panel(
            "Upstream errors",
            "Tries an upstream failed per second (then retried, or the next upstream tried): timeout, unreachable, "
            "or a 429/5xx status.",
            "ops",
            [(rate("kvgate_upstream_errors_total", FRONT, "upstream, error"), "{{upstream}} {{error}}")],
        ),
        panel(
            "In flight by upstream",
            "Requests the fronts have sent to each upstream and not finished.",
            "short",
            [("sum by (upstream) (kvgate_upstream_in_flight{" + FRONT + "})", "{{upstream}}")],
        ),
        panel(
            "Waiting by upstream",
            "Requests waiting at the fronts for an upstream's max_in_flight.",
            "short",
            [("sum by (upstream) (kvgate_upstream_waiting{" + FRONT + "})", "{{upstream}}")],
        ),
        panel(
            "Routing decisions",
            "Why each request went where it went: conversation (the replica holding its KV), documents (the replica "
            "they hash to), fewest (a new conversation: the replica with the fewest), spilled (its replica busy at "
            "spill_at, or gone), round_robin.",
            "ops",
            [(rate(decisions, FRONT, "reason"), "{{reason}}")],
        ),
        panel(
            "Routed to their KV",
            "Share of routed requests sent to the replica holding their conversation or documents.",
            "percentunit",
            [(share(rate(decisions, f'{FRONT}, reason=~"conversation|documents"'), rate(decisions, FRONT)), "placed")],
        ),
    ]


def replicas() -> list[dict[str, Any]]:
    legend = "{{instance}} {{worker}}"
    hits, misses = "kvgate_document_kv_hits_total", "kvgate_document_kv_misses_total"
    return [
        panel(
            "Replica queue",
            "Sequences each replica runs and has waiting: the load the fronts route by.",
            "short",
            [
                (ENGINES, "running " + legend),
                (f"sum by ({EACH}) (kvgate_requests_waiting{{{REPLICA}}})", "waiting " + legend),
            ],
        ),
        panel(
            "Completion tokens by replica",
            "Tokens each replica generates per second (of the processes with an engine: not a front's own count).",
            TOKENS,
            [(f"{rate('kvgate_completion_tokens_total', REPLICA, EACH)}\nand on ({EACH}) {ENGINES}", legend)],
        ),
        panel(
            "Prompt tokens reused by replica",
            "Share of each replica's prompt tokens whose KV was reused: what routing to the KV buys.",
            "percentunit",
            [
                (
                    share(
                        rate("kvgate_reused_prompt_tokens_total", REPLICA, EACH),
                        rate("kvgate_prompt_tokens_total", REPLICA, EACH),
                    ),
                    legend,
                )
            ],
        ),
        panel(
            "Document KV hit ratio by replica",
            "Of the document KV lookups in each replica's tiers, the share found.",
            "percentunit",
            [
                (
                    share(rate(hits, REPLICA, EACH), f"{rate(hits, REPLICA, EACH)} + {rate(misses, REPLICA, EACH)}"),
                    legend,
                )
            ],
        ),
        panel(
            "Document KV bytes by replica",
            "Bytes each replica's tiers hold.",
            "bytes",
            [(f"sum by ({EACH}, tier) (kvgate_document_kv_bytes{{{REPLICA}}})", legend + " {{tier}}")],
        ),
        panel(
            "Resident memory",
            "Each process's resident memory: fronts and replicas.",
            "bytes",
            [
                (
                    'sum by (job, instance, worker) (process_resident_memory_bytes{job=~"$job|$replica_job"})',
                    "{{job}} {{instance}} {{worker}}",
                ),
            ],
        ),
    ]


def build() -> dict[str, Any]:
    variables = [
        variable("job", "Fronts' job", "label_values(kvgate_upstream_in_flight, job)"),
        variable("instance", "Front", 'label_values(kvgate_upstream_in_flight{job=~"$job"}, instance)'),
        variable("replica_job", "Replicas' job", "label_values(kvgate_requests_running, job)"),
        variable("replica_instance", "Replica", 'label_values(kvgate_requests_running{job=~"$replica_job"}, instance)'),
    ]
    rows = [("Fronts", fronts()), ("Upstreams and routing", upstreams()), ("Replicas (kvgate runtimes)", replicas())]
    about = (
        "kvgate fronts over replicas (proxy.upstreams, or --workers). Replicas that are vLLM or SGLang: their own "
        "dashboards; the Upstreams row covers any replica. A front's semantic cache: kvgate-server.json."
    )
    return dashboard("kvgate-fleet", "kvgate: fleet", about, variables, rows)
