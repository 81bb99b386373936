"""The request and job lifecycle, one room per stage, in the order a request meets them.

    errors       the refusals a host can get and the ways a request can end, each with
                 its HTTP status
    answers      pure rules on delivered text: stops, counts, finish_reason, vectors
    structured   structured output: a schema checked at admission, an answer checked against
                 it at settlement (its parts: `schema_reach`, `linear_schema`, `grammar_check`)
    transitions  a request's two ends: settled or failed
    queueing     admission, a job's limits and offers, the queue timeout and fallbacks
    claims       a host takes a job; the payload it receives
    canaries     hidden jobs with known answers, queued as requests and judged at settlement
    evidence     a completion's token ids checked against its text
    settlement   the one `settle()`: bill, split, pay, delete the prompt
    failover     a dead attempt: requeued, continued once, settled or failed
    relay        a host's batches of text, appended and fanned out
    presence     the customer listening, leaving, abandoning; the text forgotten
    watchdog     liveness rules and the steps Celery beat runs

A room imports only rooms above it in this list (`.importlinter` holds the order), and the
trust rooms below the lifecycle (`marketplace.trust`: audits, reputation, routing), never a
door. `marketplace.services` is the app's write API: it re-exports what views, consumers,
tasks and tests call.
"""
