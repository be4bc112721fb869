"""The programs behind `edgespec` subcommands (`edgespec.apps`): chat, generate, convert, serve,
bench, distill, pull, list, rm, cache-prompt; the HTTP server is `apps/server`."""
