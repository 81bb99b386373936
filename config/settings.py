"""Elephant settings, read from the environment.

With no configuration the project runs on the embedded default: SQLite (in
WAL mode, every transaction BEGIN IMMEDIATE so concurrent writers queue
instead of failing) and the in-process channel layer, in one ASGI process.
`DATABASE_URL` switches to PostgreSQL and `REDIS_URL` to the Redis channel
layer and Celery broker, so several ASGI processes and workers cooperate.
The code path is the same; only these settings differ.
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from config.env import env_bool, env_float, env_int, env_str
from protocol import timing

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("ELEPHANT_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEVELOPMENT_SECRET_KEY = "dev-only-insecure-key-change-me-in-production"  # refused when DJANGO_ENV=production
SECRET_KEY = env_str("DJANGO_SECRET_KEY", DEVELOPMENT_SECRET_KEY)
DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = [h for h in env_str("ALLOWED_HOSTS", "127.0.0.1,localhost,[::1],testserver").split(",") if h]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",  # the OpenAPI schema at /api/schema/ (core/openapi.py)
    "drf_spectacular_sidecar",  # the docs page's assets, served from here: no CDN
    "channels",
    "axes",
    "accounts",
    "catalog",
    "billing",
    "hosts",
    "marketplace",
    "mesh",
    "web",
    "config",  # how the system is run: serve_demo (`make run`) and its load balancer
]

MIDDLEWARE = [
    # Django's stock middleware, subclassed in config/middleware.py: the computing ones run in
    # the event loop, and the API's paths go past the ones only pages need (no thread hops)
    "config.middleware.Security",
    "config.middleware.RequestIdMiddleware",
    "config.middleware.AsyncWhiteNoiseMiddleware",
    "config.middleware.Sessions",
    "config.middleware.Common",
    "config.middleware.Csrf",
    "config.middleware.Authentication",
    "config.middleware.Messages",
    "config.middleware.XFrameOptions",
    "axes.middleware.AxesMiddleware",  # a locked-out login answers 429 (after the others, as django-axes asks)
]
# Django's deploy checks look for the stock middleware by its exact path; ours are subclasses
# of it (Security, XFrameOptions, Csrf above; config/tests/test_api_middleware.py holds them to it)
SILENCED_SYSTEM_CHECKS = ["security.W001", "security.W002", "security.W003"]

# Login attempts (django-axes): after LOGIN_FAILURE_LIMIT failures for one e-mail from one
# address, that pair is locked out for LOGIN_COOLOFF_MINUTES (one attacker cannot lock every
# account, nor one forgetful user everyone behind their address). Sign-up is limited per
# address too (django-ratelimit, SIGNUP_RATE).
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = env_float("LOGIN_COOLOFF_MINUTES", 15.0, minimum=0.1) / 60  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "web/locked_out.html"
AXES_IPWARE_PROXY_COUNT = env_int("TRUSTED_PROXY_COUNT", 0, minimum=0)  # behind HAProxy / a TLS proxy: 1
AXES_VERBOSE = False
SIGNUP_RATE = env_str("SIGNUP_RATE", "10/h")
# Password-reset e-mails (django-ratelimit): at most this many asked for one e-mail address
# (whoever asks: nobody's inbox is flooded, and the limit says nothing of whether an account
# has that address), and from one client address (whichever addresses it names).
PASSWORD_RESET_EMAIL_RATE = env_str("PASSWORD_RESET_EMAIL_RATE", "3/h")
PASSWORD_RESET_IP_RATE = env_str("PASSWORD_RESET_IP_RATE", "10/h")
RATELIMIT_IP_META_KEY = "config.middleware.client_ip"

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "billing.context_processors.stripe_mode",
            ],
        },
    },
]

DATABASE_URL = env_str("DATABASE_URL")
# Connections persist per worker thread: opening one per query costs milliseconds on the hot path.
DB_CONN_MAX_AGE = env_int("DB_CONN_MAX_AGE", 600, minimum=0)
if DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=DB_CONN_MAX_AGE)}
else:
    _sqlite = Path(env_str("SQLITE_PATH", str(VAR_DIR / "elephant.sqlite3")))
    DATABASES = {
        "default": {
            "ENGINE": "core.sqlite",  # Django's, with this process's writers queued on one lock
            "NAME": _sqlite,  # type: ignore[typeddict-item]  # Django's SQLite takes a Path; the stubs say str
            "CONN_MAX_AGE": DB_CONN_MAX_AGE,
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                # secure_delete: deleted rows (a handed-over answer's text) are overwritten with zeros,
                # not left in the file's free pages
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA secure_delete=ON;",
            },
            # A file, not memory, so end-to-end tests can share it with the
            # gateway and host processes they start.
            "TEST": {"NAME": str(_sqlite.with_name(_sqlite.stem + "-test.sqlite3"))},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL")
# "pubsub" (channels-redis' RedisPubSubChannelLayer: Redis pushes each message to the process)
# or "lists" (its RedisChannelLayer: one BZPOPMIN round trip per message received, which
# queued token batches for seconds at 25 streams); BENCHMARKS.md compares them.
REDIS_CHANNEL_LAYER = env_str("REDIS_CHANNEL_LAYER", "pubsub")
CHANNEL_EXPIRY_SECONDS = env_int("CHANNEL_EXPIRY_SECONDS", 10)  # a customer's text in the channel layer, at most
if REDIS_URL and REDIS_CHANNEL_LAYER == "pubsub":
    CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
    }
elif REDIS_URL:
    if REDIS_CHANNEL_LAYER != "lists":
        raise ImproperlyConfigured(f"REDIS_CHANNEL_LAYER must be 'lists' or 'pubsub', not {REDIS_CHANNEL_LAYER!r}")
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # channels-redis waits on a BZPOPMIN that Redis ends after 5 s, and redis-py's
            # default socket timeout is also 5 s: on a busy machine the client gave up
            # first and the waiting request died with a 500. The socket waits longer.
            # Token messages wait at most CHANNEL_EXPIRY_SECONDS for their listener (channels-redis's
            # default is 60): a listener that misses one re-reads the text from the database.
            "CONFIG": {
                "hosts": [{"address": REDIS_URL, "socket_timeout": 30}],
                "capacity": 1000,
                "expiry": CHANNEL_EXPIRY_SECONDS,
            },
        }
    }
else:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "core.layers.TidyInMemoryChannelLayer",
            "CONFIG": {"capacity": 1000, "expiry": CHANNEL_EXPIRY_SECONDS},
        }
    }

# Celery: Redis when configured; otherwise a broker on the local file system
# that needs no server, so `make run` still runs the watchdogs (kombu's file-system
# transport with atomic writes: core/broker.py).
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_BROKER_TRANSPORT_OPTIONS: dict = {}
else:
    _queue_dir = VAR_DIR / "celery-queue"
    _queue_dir.mkdir(exist_ok=True)
    (VAR_DIR / "celery-control").mkdir(exist_ok=True)
    CELERY_BROKER_URL = "elephant-files://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_queue_dir),
        "data_folder_out": str(_queue_dir),
        "control_folder": str(VAR_DIR / "celery-control"),
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
WATCHDOG_INTERVAL_SECONDS = env_float("WATCHDOG_INTERVAL_SECONDS", 2.0, minimum=0.1)

# Django's full set: not like the address, 8+ characters, not a common or all-digit password
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)
STATICFILES_DIRS = [BASE_DIR / "static"]
# WhiteNoise serves the pages' CSS/JS (and the admin's) straight from the source folders, so
# `make run` needs no collectstatic; set it false after a collectstatic into STATIC_ROOT.
WHITENOISE_USE_FINDERS = env_bool("WHITENOISE_USE_FINDERS", True)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
    "EXCEPTION_HANDLER": "core.errors.api_exception_handler",
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["core.parsers.JsonParser"],
    "DEFAULT_SCHEMA_CLASS": "core.openapi.ApiSchema",
}

# The OpenAPI schema (drf-spectacular): generated from the views, served at /api/schema/,
# browsed at /api/docs/ with Swagger UI's files from drf-spectacular-sidecar.
SPECTACULAR_SETTINGS = {
    "TITLE": "Elephant API",
    "DESCRIPTION": (
        "The OpenAI-compatible customer API (`/v1/`), the host API (`/hosts/api/`, `/billing/api/host/`) and the "
        "mesh API (`/api/`). Errors are OpenAI's: `{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`."
    ),
    "VERSION": "1",
    "OAS_VERSION": "3.1.0",  # JSON Schema 2020-12: an event stream's `data` is documented as JSON (contentSchema)
    "SERVE_INCLUDE_SCHEMA": False,
    "PATH_CONVERTER_OVERRIDES": {
        "id": {"type": "integer", "minimum": 0, "maximum": 10**18 - 1}
    },  # core.http.IdConverter
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},  # no badge fetched from swagger.io
}

# Largest request body the API accepts (bytes); larger gets a 413.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("MAX_BODY_BYTES", 1_000_000, minimum=1024)

# Marketplace behaviour. A timing a host relies on takes its default from protocol/timing.py
# (`timing.X`), where protocol/tests/test_timing.py holds it against the host's.
QUEUE_TIMEOUT_SECONDS = env_float("QUEUE_TIMEOUT_SECONDS", 30.0, minimum=0.1)
HOST_SHARE_PERCENT = 80
MAX_TOKENS_LIMIT = env_int("MAX_TOKENS_LIMIT", 4096, minimum=1)
DEFAULT_MAX_TOKENS = env_int("DEFAULT_MAX_TOKENS", 256, minimum=1)
CLAIM_MAX_WAIT_SECONDS = timing.CLAIM_MAX_WAIT_SECONDS
HOST_OFFLINE_AFTER_SECONDS = env_int("HOST_OFFLINE_AFTER_SECONDS", timing.HOST_OFFLINE_AFTER_SECONDS, minimum=1)
DB_THREADS = env_int("DB_THREADS", 32, minimum=2)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "WARNING")},
    # a customer's 4xx is the answer, not the gateway's trouble (the access log has the line);
    # a stranger's stream of bad requests would otherwise be a stream of warnings. 5xx stay.
    "loggers": {"django.request": {"level": env_str("LOG_LEVEL_REQUESTS", "ERROR")}},
}
STALL_SECONDS = env_float("STALL_SECONDS", timing.STALL_SECONDS, minimum=0.1)
# A host whose batch said its text ended (finish_reason) completes at once; one that has not
# within this is dead, and its whole answer settles (marketplace/lifecycle/failover.py).
COMPLETE_GRACE_SECONDS = env_float("COMPLETE_GRACE_SECONDS", timing.COMPLETE_GRACE_SECONDS, minimum=0.1)
# A host whose WebSocket drops is dead unless it reopens one within this (mahout retries after 1 s).
HOST_RECONNECT_GRACE_SECONDS = env_float(
    "HOST_RECONNECT_GRACE_SECONDS", timing.HOST_RECONNECT_GRACE_SECONDS, minimum=0.0
)
OUTPUT_RETENTION_SECONDS = env_int("OUTPUT_RETENTION_SECONDS", 300, minimum=0)
# A response stored on request (`store: true` on /v1/responses) is kept this long, so that a
# later turn can continue it (`previous_response_id`), then deleted by the watchdog's sweep. An
# hour, not OpenAI's 30 days: every other prompt here is deleted once its answer is handed over,
# so a conversation kept by choice should outlive only the session that continues it (an agent's
# turns and tool round trips come seconds to minutes apart).
RESPONSE_STORE_SECONDS = env_int("RESPONSE_STORE_SECONDS", 3600, minimum=1)
# What stored responses may hold, in bytes of compact UTF-8 JSON (their normalised conversation and
# the fields the Response repeats): per response, and for all of an account's live ones together.
# Over either, a `store: true` request is a 400 before anything is queued or billed. One response's
# limit is the largest request body's (MAX_BODY_BYTES) by default: a conversation is bounded by its
# model's context anyway; the account's holds fifty such, or an agent's many short turns for an hour.
RESPONSE_STORE_MAX_BYTES = env_int("RESPONSE_STORE_MAX_BYTES", 1_000_000, minimum=1024)
RESPONSE_STORE_ACCOUNT_MAX_BYTES = env_int("RESPONSE_STORE_ACCOUNT_MAX_BYTES", 50_000_000, minimum=1024)
# Prompt caching (issue 53): a prompt's blocks of this many tokens, routed to a host, are remembered
# for the same account and model until unused for PROMPT_CACHE_SECONDS (hosts drop their KV then too).
PROMPT_CACHE_BLOCK_TOKENS = env_int("PROMPT_CACHE_BLOCK_TOKENS", 64, minimum=1)
PROMPT_CACHE_SECONDS = env_float("PROMPT_CACHE_SECONDS", timing.PROMPT_CACHE_SECONDS, minimum=0.0)
# a customer schema's conversion to a grammar, in a child process (protocol/grammar_fence.py)
GRAMMAR_CHECK_SECONDS = env_float("GRAMMAR_CHECK_SECONDS", 2.0, minimum=0.1)
GRAMMAR_CHECK_MEMORY_MB = env_int("GRAMMAR_CHECK_MEMORY_MB", 1024, minimum=256)
# A customer whose connection went away and did not re-attach within this is gone: the job is
# cancelled (its host stops at its next batch) and only the text delivered so far is billed.
ABANDON_GRACE_SECONDS = env_float("ABANDON_GRACE_SECONDS", 15.0, minimum=0.0)

# Verification (marketplace/lifecycle/canaries.py): hidden jobs with known answers. Only models with
# references (`manage.py canary_references`) get canaries.
# MAHOUT_MIN_VERSION: older ones are refused (426): 0.4.0 draws under a grammar by the specified sampler too, so
# its structured answers can be audited; 0.5.0's rings draw top_p < 1 by it, so their answers are audited whatever
# the top_p; 0.6.0's ring stages keep and hand over their evidence (a 0.5.0 stage would be blamed by every inquiry
# into its ring) and its rings heal a cut word as a host does (a 0.5.0 ring's honest answers to text they resume
# fail their audits); 0.7.0's rings continue an answer under a grammar (a 0.6.0 bridge refuses the continuation,
# which the gateway now routes to rings)
MAHOUT_MIN_VERSION = env_str("MAHOUT_MIN_VERSION", "0.7.0")
# A heartbeat or claim whose `version` is not a version (missing, or "sim") cannot be held to
# MAHOUT_MIN_VERSION and is refused (426); the tests' synthetic hosts are let in with this on
# (conftest.py, testkit.stack.stack_env). Never on in production.
MAHOUT_UNVERSIONED_ALLOWED = env_bool("MAHOUT_UNVERSIONED_ALLOWED", False)
METRICS_TOKEN = env_str("METRICS_TOKEN")  # Prometheus' bearer token for GET /metrics (staff may also sign in)
# Audits (marketplace/trust/audits.py): the share of completed real jobs re-read under the real model
# before their host is paid; every job of a host in probation by default.
AUDIT_ENABLED = env_bool("AUDIT_ENABLED", True)
AUDIT_RATE = env_float("AUDIT_RATE", 0.05, minimum=0.0)
AUDIT_PROBATION_RATE = env_float("AUDIT_PROBATION_RATE", 1.0, minimum=0.0)
# Tokens of an audited answer checked, drawn at random (0: every token). The prefill is read
# up to the last one drawn, and only those rows of the output head are computed: the head of
# a large vocabulary is most of an every-token audit's cost (bench/trust.py, BENCHMARKS.md).
# A failure a trusted host reports is confirmed by a second one checking every token.
AUDIT_TOKENS = env_int("AUDIT_TOKENS", 16, minimum=0)
# A model whose weights the gateway lacks is scored by trusted hosts of other owners, paid to score it: an audit
# no scorer decided within this long is read by the gateway where it holds the weights, else refunded to its customer
# unscored (the host neither paid nor blamed; never released unchecked); a scorer silent this long is replaced; a
# scorer in the minority of a decided split this often in a day loses its trust.
AUDIT_SCORER_WAIT_SECONDS = env_float("AUDIT_SCORER_WAIT_SECONDS", 1800.0, minimum=0.0)
AUDIT_SCORE_TIMEOUT_SECONDS = env_float("AUDIT_SCORE_TIMEOUT_SECONDS", 300.0, minimum=1.0)
AUDIT_SCORER_MAX_OVERRULED = env_int("AUDIT_SCORER_MAX_OVERRULED", 2, minimum=1)
# A scorer that declined (or went silent on) this many audits in a day is handed no more that day: it cannot choose
# which answers it reads (a colluder declining all but its partner's would pass only those).
AUDIT_SCORER_MAX_DECLINED = env_int("AUDIT_SCORER_MAX_DECLINED", 5, minimum=1)  # per model, per cause
# Only an owner with a history scores audits (marketplace/trust/reputation.py: `scorer_owner_seasoned`): an account this
# many days old whose own hosts' jobs passed this many audits that were read. An e-mail is free, and each owner is a
# vote on an audit: a sybil must pay for its vote in time and in honest, checked work before it can cast one.
AUDIT_SCORER_OWNER_MIN_AGE_DAYS = env_float("AUDIT_SCORER_OWNER_MIN_AGE_DAYS", 14.0, minimum=0.0)
AUDIT_SCORER_OWNER_MIN_PASSED_AUDITS = env_int("AUDIT_SCORER_OWNER_MIN_PASSED_AUDITS", 20, minimum=0)
# The share of trusted hosts' first passes that wait for a second scorer's look (a pass that a
# confirmed failure then goes against is a strike): a scorer passing a cheat is caught so.
AUDIT_PASS_RECHECK_RATE = env_float("AUDIT_PASS_RECHECK_RATE", 0.1, minimum=0.0)
# A ring's failed audit opens an inquiry (marketplace/trust/ring_inquiries.py): its stages hand over what they kept of
# the request within this long (a silent stage kept nothing), at most this many bytes each.
RING_EVIDENCE_WAIT_SECONDS = env_float("RING_EVIDENCE_WAIT_SECONDS", timing.RING_EVIDENCE_WAIT_SECONDS, minimum=0.0)
RING_EVIDENCE_MAX_BYTES = env_int("RING_EVIDENCE_MAX_BYTES", 256 * 2**20, minimum=512 * 1024)
CANARY_ENABLED = env_bool("CANARY_ENABLED", True)
# The operator's own canary prompts (JSON: a list of prompts, or {"prompts": [...],
# "system_prompts": [...]}; marketplace/lifecycle/canaries.py), kept off the repository: the shipped
# corpus is public, so a cheat that reads our code knows every canary built from it.
CANARY_PROMPTS_FILE = env_str("CANARY_PROMPTS_FILE", "")
if CANARY_PROMPTS_FILE and not Path(CANARY_PROMPTS_FILE).is_file():
    raise ImproperlyConfigured(f"CANARY_PROMPTS_FILE={CANARY_PROMPTS_FILE!r}: no such file")
CANARY_PROBATION_SECONDS = env_float("CANARY_PROBATION_SECONDS", 20.0, minimum=0.0)  # a new host: one every 20 s
CANARY_TRUSTED_SECONDS = env_float("CANARY_TRUSTED_SECONDS", 3600.0, minimum=0.0)  # a trusted one: one an hour
CANARY_TRUST_AFTER = env_int("CANARY_TRUST_AFTER", 5, minimum=1)  # passed canaries (none failed) to leave probation
CANARY_TIE_GAP = env_float(
    "CANARY_TIE_GAP", 1.0, minimum=0.0
)  # top-2 log-prob gap below which honest machines may part
CANARY_SCORER_THREADS = env_int("CANARY_SCORER_THREADS", 2, minimum=1)  # a worker reading answers under the real model
CANARY_MIN_EXACT_CHARS = env_int("CANARY_MIN_EXACT_CHARS", 12, minimum=1)  # references with less to check are dropped
# A canary of a model the gateway can audit is sampled like customers' jobs (their temperature,
# top_p and max_tokens, drawn from recent requests; at most this many tokens) and judged by an audit.
CANARY_MAX_TOKENS = env_int("CANARY_MAX_TOKENS", 128, minimum=1)

# Reputation (marketplace/trust/reputation.py): a new host is in probation until it has passed
# CANARY_TRUST_AFTER canaries (none failed), completed TRUST_AFTER_JOBS jobs and been a host for
# TRUST_AFTER_SECONDS; a failed canary puts it back. It runs at most HOST_PROBATION_MAX_JOBS jobs
# at once (a trusted host: its slots, at most HOST_TRUSTED_MAX_JOBS) and trusted hosts get offers first.
TRUST_AFTER_JOBS = env_int("TRUST_AFTER_JOBS", 10, minimum=0)
TRUST_AFTER_SECONDS = env_float("TRUST_AFTER_SECONDS", 3600.0, minimum=0.0)
HOST_PROBATION_MAX_JOBS = env_int("HOST_PROBATION_MAX_JOBS", 4, minimum=1)
HOST_TRUSTED_MAX_JOBS = env_int("HOST_TRUSTED_MAX_JOBS", 64, minimum=1)
# Machines one account may register (Sybils are not free); an operator raises it for one owner
# in the admin ("Host allowances").
HOSTS_PER_ACCOUNT = env_int("HOSTS_PER_ACCOUNT", 10, minimum=1)
# Speed routing trusts only what the gateway measured: a reported tokens/s counts at most this
# much until the host's own jobs measured it, and a host whose report is over twice what it
# delivers is "overstated" (its report ignored, its offers after honest hosts').
ROUTING_UNMEASURED_MAX_TPS = env_float("ROUTING_UNMEASURED_MAX_TPS", 50.0, minimum=0.1)
# Earnings vest: a job's earnings are payable after this long; a host caught cheating before
# then forfeits what has not vested (a ledger entry with the reason).
EARNINGS_VEST_SECONDS = env_float("EARNINGS_VEST_SECONDS", 7 * 24 * 3600.0, minimum=0.0)
# Every job has a deadline: the queue timeout, a start allowance (loading, prefill) and its
# max_tokens at the slowest acceptable speed.
JOB_START_ALLOWANCE_SECONDS = env_float("JOB_START_ALLOWANCE_SECONDS", 120.0, minimum=1.0)
# Before its first token a host may be loading or prefilling (seed 001: the stall clock is a
# stream's): it may take what its own benchmark says (load unless its catalog said the model was
# loaded at its claim, first-token latency, the prompt at its prompt tokens/s) plus this small
# floor, and up to three times its figures while it reports progress (each report within
# JOB_PROGRESS_SILENCE_SECONDS; mahout reports every 5 s), never past the allowance above
# (marketplace/lifecycle/watchdog.py).
JOB_START_FLOOR_SECONDS = env_float("JOB_START_FLOOR_SECONDS", 5.0, minimum=0.1)
JOB_PROGRESS_SILENCE_SECONDS = env_float(
    "JOB_PROGRESS_SILENCE_SECONDS", timing.JOB_PROGRESS_SILENCE_SECONDS, minimum=0.1
)
JOB_MIN_TOKENS_PER_SECOND = env_float("JOB_MIN_TOKENS_PER_SECOND", 2.0, minimum=0.01)

# Billing: Stripe top-ups and host payouts (issue 3). Without STRIPE_SECRET_KEY and
# STRIPE_WEBHOOK_SECRET, top-ups answer "not configured" and operators grant credit
# from the admin. STRIPE_API_BASE points the client at a server speaking Stripe's API
# instead of Stripe: local test mode's stand-in (billing/stripe_local.py; `make run`
# starts it and sets all three when STRIPE_SECRET_KEY is unset) or a test's. Every page
# then carries a test-mode banner. Checkout returns to the gateway as the customer
# reached it (the request's scheme, host and port).
STRIPE_SECRET_KEY = env_str("STRIPE_SECRET_KEY")
STRIPE_WEBHOOK_SECRET = env_str("STRIPE_WEBHOOK_SECRET")
STRIPE_API_BASE = env_str("STRIPE_API_BASE")
STRIPE_WEBHOOK_TOLERANCE_SECONDS = 300
STRIPE_TIMEOUT_SECONDS = env_float("STRIPE_TIMEOUT_SECONDS", 20.0, minimum=1.0)
STRIPE_MAX_RETRIES = env_int("STRIPE_MAX_RETRIES", 2, minimum=0)
BILLING_CURRENCY = "usd"
TOPUP_MIN_CENTS = env_int("TOPUP_MIN_CENTS", 500, minimum=50)
TOPUP_MAX_CENTS = env_int("TOPUP_MAX_CENTS", 50_000, minimum=50)
PAYOUT_MINIMUM_UCENTS = env_int("PAYOUT_MINIMUM_UCENTS", 1_000_000_000, minimum=1_000_000)  # $10
RECONCILE_INTERVAL_SECONDS = env_float("RECONCILE_INTERVAL_SECONDS", 300.0, minimum=1.0)
USAGE_MAX_DAYS = env_int("USAGE_MAX_DAYS", 366, minimum=1)
USAGE_PAGE_MAX = env_int("USAGE_PAGE_MAX", 1000, minimum=1)  # requests per page of GET /v1/usage
# A continuation avoids the host whose attempt died for this long, then anyone may take it.
CONTINUATION_GRACE_SECONDS = env_float("CONTINUATION_GRACE_SECONDS", timing.CONTINUATION_GRACE_SECONDS, minimum=0)

# Model-aware routing (issue 5). Jobs go to a host that has the model loaded ("warm");
# a host whose catalog is missing, stale or unreadable counts as possibly warm. Within the
# warm set ROUTING_STRATEGY (least-connections | weighted; per model in the catalog) picks
# the host a new job is offered to; the offer lapses after ROUTING_OFFER_SECONDS and
# then any warm host may take it; hosts without the model wait ROUTING_COLD_GRACE_SECONDS
# when a warm host was offered it, none when no warm host is online.
ROUTING_STRATEGY = env_str("ROUTING_STRATEGY", "least-connections")
if ROUTING_STRATEGY not in ("least-connections", "weighted"):
    raise ImproperlyConfigured("ROUTING_STRATEGY must be 'least-connections' or 'weighted'")
ROUTING_OFFER_SECONDS = env_float("ROUTING_OFFER_SECONDS", 1.0, minimum=0)
ROUTING_COLD_GRACE_SECONDS = env_float("ROUTING_COLD_GRACE_SECONDS", 2.0, minimum=0)
# When every warm host is busy, cold hosts wait until the soonest is expected to free a slot
# (plus the grace above), but never longer than this (routing.cold_wait_seconds).
ROUTING_COLD_MAX_WAIT_SECONDS = env_float("ROUTING_COLD_MAX_WAIT_SECONDS", 30.0, minimum=0)
# Deliberate redundancy (marketplace.trust.redundancy): how long an idle host asked to load a
# latency-critical model has to report it loaded before another host is asked instead.
WARM_ASK_SECONDS = env_float("WARM_ASK_SECONDS", timing.WARM_ASK_SECONDS, minimum=1)
ROUTING_WEIGHT_WINDOW_SECONDS = env_int("ROUTING_WEIGHT_WINDOW_SECONDS", 3600, minimum=1)
CATALOG_STALE_SECONDS = env_float("CATALOG_STALE_SECONDS", timing.CATALOG_STALE_SECONDS, minimum=1)
MODEL_LIST_CACHE_SECONDS = env_float("MODEL_LIST_CACHE_SECONDS", timing.MODEL_LIST_CACHE_SECONDS, minimum=0)
# A host that drops or fails more than this many jobs in an hour rests in maintenance.
HOST_MAX_FAILURES_PER_HOUR = env_int("HOST_MAX_FAILURES_PER_HOUR", 5, minimum=1)

# MoE expert market (issue 8): freshness windows of coordinator reports and worker
# heartbeats, how long an unregistered volunteer's assignment is held, and how long a
# coordinator must be quiet before extra workers are retired.
MOE_COORDINATOR_STALE_SECONDS = env_float(
    "MOE_COORDINATOR_STALE_SECONDS", timing.MOE_COORDINATOR_STALE_SECONDS, minimum=1
)
MOE_WORKER_STALE_SECONDS = env_float("MOE_WORKER_STALE_SECONDS", timing.MOE_WORKER_STALE_SECONDS, minimum=1)
MOE_ASSIGN_TTL_SECONDS = env_float("MOE_ASSIGN_TTL_SECONDS", 120.0, minimum=1)
MOE_COOLDOWN_SECONDS = env_float("MOE_COOLDOWN_SECONDS", 30.0, minimum=0)
# A saturated coordinator that measured its workers and engages none of them (its latency-aware
# rule finds computing here faster than their round trips) gets no boost after this long: more
# volunteers like them would only sit idle, and those beyond the base are released. After the
# retry window the boost is offered again once (new volunteers may be closer or faster).
MOE_UNUSED_GRACE_SECONDS = env_float("MOE_UNUSED_GRACE_SECONDS", 60.0, minimum=0)
MOE_UNUSED_RETRY_SECONDS = env_float("MOE_UNUSED_RETRY_SECONDS", 900.0, minimum=1)
# A failed audit of a coordinator's answer that its workers helped compute is excused once in
# this window (the customer is refunded all the same): a volunteer's wrong experts must not put
# the operator's coordinator in maintenance. For the window every batch of its workers is
# recomputed (check share 1), so a worker that is wrong again is blamed by the coordinator, and
# a second failure is the coordinator's own.
MOE_EXCUSE_SECONDS = env_float("MOE_EXCUSE_SECONDS", 86400.0, minimum=1)
# A volunteer host that is not trusted serves experts on probation (mesh/experts/services.py):
# its coordinator recomputes this share of its batches (1 or more: every one) until its
# workers have passed MOE_PROBATION_CHECKS recomputes, then the coordinator's usual share.
MOE_PROBATION_CHECK_SHARE = env_float("MOE_PROBATION_CHECK_SHARE", 0.5, minimum=0.0)
MOE_PROBATION_CHECKS = env_int("MOE_PROBATION_CHECKS", 500, minimum=0)
RING_ALLOW_PRIVATE_STAGES = env_bool(
    "RING_ALLOW_PRIVATE_STAGES", False
)  # strangers' ring stages at private addresses (local tests)
MOE_ALLOW_PRIVATE_WORKERS = env_bool("MOE_ALLOW_PRIVATE_WORKERS", False)  # workers at private addresses (local swarms)

# Web pages (issue 6): session login for people; e-mail goes to the console unless configured.
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_FILE_PATH = env_str("EMAIL_FILE_PATH", str(VAR_DIR / "mail"))  # the file backend's folder (tests read it)
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "Elephant <noreply@localhost>")
# Requests a customer sees in the recent-requests table.
WEB_RECENT_REQUESTS = env_int("WEB_RECENT_REQUESTS", 50, minimum=1)

# Production (issue 17): `DJANGO_ENV=production` refuses to start — every manage.py command
# and every server process — without a real secret key and an explicit ALLOWED_HOSTS, never
# runs with DEBUG, and turns on what `manage.py check --deploy` asks for: secure cookies, HSTS,
# the redirect to HTTPS, and trusting the TLS proxy's X-Forwarded-Proto (so links are https).
DJANGO_ENV = env_str("DJANGO_ENV", "development")
if DJANGO_ENV not in ("development", "production"):
    raise ImproperlyConfigured(f"DJANGO_ENV={DJANGO_ENV!r}: use 'development' (the default) or 'production'")
if DJANGO_ENV == "production":
    if SECRET_KEY == DEVELOPMENT_SECRET_KEY or len(SECRET_KEY) < 50 or len(set(SECRET_KEY)) < 5:
        raise ImproperlyConfigured(
            "DJANGO_ENV=production needs DJANGO_SECRET_KEY: at least 50 random characters, e.g. "
            "`python -c 'import secrets; print(secrets.token_urlsafe(50))'`"
        )
    if not env_str("ALLOWED_HOSTS"):
        raise ImproperlyConfigured(
            "DJANGO_ENV=production needs ALLOWED_HOSTS: the gateway's public host names, comma-separated"
        )
    if DEBUG:
        raise ImproperlyConfigured("DJANGO_ENV=production never runs with DJANGO_DEBUG")
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")  # TLS ends at the proxy in front
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_REDIRECT_EXEMPT = [
        r"^healthz$",
        r"^v1/models$",
    ]  # a load balancer's health check speaks plain HTTP to the backends
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    CSRF_TRUSTED_ORIGINS = [f"https://{host}" for host in ALLOWED_HOSTS if not host.startswith(".")]
    if EMAIL_BACKEND.endswith(("console.EmailBackend", "locmem.EmailBackend")):
        import sys

        print(
            f"WARNING: DJANGO_ENV=production but EMAIL_BACKEND is {EMAIL_BACKEND}: password-reset and sign-up e-mails "
            "go nowhere a user can read them. Set EMAIL_BACKEND (and EMAIL_HOST, ...) to a real SMTP server.",
            file=sys.stderr,
            flush=True,
        )
