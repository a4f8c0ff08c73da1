#!/bin/sh
# As the official image: flags alone are nats-server's.
set -e
case "${1:-}" in
  '' | -*) set -- nats-server "$@" ;;
esac
exec "$@"
