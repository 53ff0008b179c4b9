"""`ember serve`: the gateway, autoscaler and a backend for one app, in the foreground."""
import argparse


def port(text: str) -> int:
    """A TCP port for argparse: 0 to 65535."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number: use 0 to 65535 (0 picks a free one)") \
            from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a port number: use 0 to 65535 (0 picks a free one)")
    return number


def add_to(sub, epilog: str) -> None:
    p = sub.add_parser("serve", help="run gateway, autoscaler and local backend for APP.py in the foreground",
                       description="Serve APP.py (or, with --model DIR, a Hugging Face model directory behind an "
                                   "OpenAI-compatible API) over HTTPS on this machine; prints the URL and the dev CA "
                                   "path.",
                       epilog=epilog)
    p.add_argument("app", nargs="?", help="the app file, e.g. examples/hello.py")
    p.add_argument("--model", metavar="DIR",
                   help="serve this Hugging Face model directory with no app file: a causal LM at /NAME/v1/chat/"
                        "completions, /NAME/v1/completions and /NAME/v1/responses (weight snapshots on), an encoder "
                        "(BERT-like) at /NAME/v1/embeddings")
    p.add_argument("--name", help="with --model: the model's name in requests and the app's in URLs (default the "
                                  "directory's name)")
    p.add_argument("--quantization", choices=["fp8"],
                   help="with --model, a causal LM: fp8 quantizes its decoder's weights to FP8 as they load (a scale "
                        "per row; half the bytes, Hopper's FP8 tensor cores; answers differ by the rounding). Default: "
                        "the weights as their dtype holds them")
    p.add_argument("--kv-cache-dtype", choices=["fp8"],
                   help="with --model, a causal LM: fp8 keeps its KV cache in FP8 (e4m3, a scale of 1): twice the "
                        "tokens cached in the same memory, half the bytes a decode step's attention reads; answers "
                        "differ by the rounding. Needs an Ada or Hopper GPU. Default: the model's dtype")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); 0.0.0.0 serves other machines too, and the printed "
                        "URL then names this machine's address")
    p.add_argument("--port", type=port, default=8443, help="port to listen on; 0 picks a free one (default 8443)")
    p.add_argument("--new-key", metavar="NAME",
                   help="also create an API key NAME (revoking an earlier live key of that name) and print a "
                        "ready-to-paste curl")
    p.add_argument("--tls-name", action="append", default=[], metavar="NAME",
                   help="a DNS name or IP address clients use, added to the dev certificate (repeatable; it already "
                        "covers localhost, this machine's hostname and addresses, and --host)")
    p.add_argument("--tls-cert", metavar="PEM", help="serve this certificate (chain) instead of the dev CA's; "
                                                     "needs --tls-key")
    p.add_argument("--tls-key", metavar="PEM", help="the unencrypted private key of --tls-cert")
    p.add_argument("--backend", choices=["local", "aws"], default="local",
                   help="where replicas run: local processes, or the AWS Auto Scaling Group named by EMBER_AWS_ASG "
                        "(default local)")
    p.add_argument("--parked-ram", metavar="SIZE",
                   help="host RAM parked replicas may hold, e.g. 8GiB (default a quarter of RAM)")
    p.add_argument("--redis", metavar="URL", help="share rate-limit state with other gateways in this Redis "
                                                   "(default EMBER_REDIS_URL; else kept in this process)")
    p.add_argument("--routing", choices=["affinity", "round-robin", "least-loaded"], default="affinity",
                   help="how a replica is chosen: X-Session-ID or prompt prefix by bounded-load hashing, else least "
                        "loaded (affinity, the default); in turn; or least loaded")
    p.add_argument("--no-watch", dest="watch", action="store_false",
                   help="do not redeploy when the app file or its local imports change (by default an edit redeploys "
                        "within a second; in-flight calls finish on the old version)")
    limits = p.add_argument_group("what one client may take (each also an environment variable; the flag wins)")
    limits.add_argument("--header-timeout", metavar="SECONDS",
                        help="seconds a connection may take to finish its TLS handshake, and again to send a "
                             "request's headers, before it is closed (EMBER_HEADER_TIMEOUT; default 10)")
    limits.add_argument("--max-connections", metavar="N",
                        help="client connections held at once; past it the one waiting longest for its headers is "
                             "closed (EMBER_MAX_CONNECTIONS; default what the file-descriptor limit allows, less 512)")
    limits.add_argument("--body-timeout", metavar="SECONDS",
                        help="seconds a request body may take to arrive before a 408 (EMBER_BODY_TIMEOUT; default 60)")
    limits.add_argument("--body-budget", metavar="SIZE",
                        help="request-body bytes held at once across all requests, e.g. 512MiB; past it a request "
                             "waits up to 10 s, its body unread, then gets 503 (EMBER_BODY_BUDGET; default 256MiB, "
                             "at least 16MiB)")
    limits.add_argument("--send-timeout", metavar="SECONDS",
                        help="seconds a client may take no bytes of a streamed reply before it is dropped and its "
                             "replica slot freed (EMBER_SEND_TIMEOUT; default 60)")
    p.set_defaults(run=serve)


def serve(args: argparse.Namespace) -> int:
    from ember.gateway.client_limits import ClientLimits
    from ember.gateway.serve import serve

    if (args.app is None) == (args.model is None):
        raise ValueError("give an app file (ember serve APP.py) or a model directory (ember serve --model DIR), "
                         "one of the two")
    limits = ClientLimits.resolve(header_timeout=args.header_timeout, max_connections=args.max_connections,
                                  body_timeout=args.body_timeout, body_budget=args.body_budget,
                                  send_timeout=args.send_timeout)
    if args.name and not args.model:
        raise ValueError("--name names the model of --model DIR; an app file names its app in ember.App(...)")
    if args.quantization and not args.model:
        raise ValueError("--quantization applies to --model DIR; an app file sets EngineConfig(quantization=...)")
    if args.kv_cache_dtype and not args.model:
        raise ValueError("--kv-cache-dtype applies to --model DIR; an app file sets "
                         "EngineConfig(kv_cache_dtype=...)")
    app_path, openai_model, watch = args.app, None, args.watch
    if args.model:
        from ember.cli.model import write_model_app
        from ember.home import Home

        written = write_model_app(args.model, args.name, Home(), args.quantization, args.kv_cache_dtype)
        app_path, openai_model, watch = written.path, (written.served, written.kind), False  # nothing to edit
    return serve(app_path, args.host, args.port, args.new_key, args.backend, args.parked_ram, args.redis, args.routing,
                 watch, openai_model, args.tls_name, args.tls_cert, args.tls_key, limits)
