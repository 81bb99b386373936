"""The marketplace: requests in, jobs out to hosts, answers back, money settled.

Its wings, top to bottom; each imports only the wings below it (`.importlinter`,
"marketplace-wings"), and the two doors do not import each other:

    tasks, admin, apps, management  what Celery, the admin and Django start
    openai/      the customer's door: /v1/, the chat socket, usage
    hostdoor/    the host's door: /hosts/api/, the host socket
    services     the write API the doors call: the lifecycle's entry points, named
    lifecycle/   a request's stages, admission to settlement (their order: lifecycle/__init__.py)
    trust/       audits, reputation, routing: whom to believe, whom to send work to
    selectors, metrics  reads
    logprobs, models    the tables, and the helpers every wing shares

The verifier that re-reads an answer under the real model lives below the gateway and the
host client both (`scorer`).
"""
