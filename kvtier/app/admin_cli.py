"""``kvtier admin``: a daemon's namespaces, for its admin (issue 12): list, empty, delete.

    kvtier admin ls    --url unix:///run/kvtier/kvtier.sock
    kvtier admin clear --url URL --namespace HEX [--tenant NAME]    # one namespace, every tier
    kvtier admin clear --url URL --all --yes                        # every namespace of every tenant
    kvtier admin rm    --url URL --namespace HEX [--tenant NAME] --yes

(``kvtier cache`` is the local side: the data dirs on this machine, kvtier.app.cache_cli.)

The token (``--token``, env ``KVTIER_TOKEN``) must be the daemon's ``--token`` or an admin
token of its ``--token-file``; ``--tenant`` defaults to the token's own tenant. The calls go
through :class:`kvtier.tiers.daemon_client.DaemonClient` (a signed session over ``http://``,
the Unix socket, capped replies); the routes are in :mod:`kvtier.server.admin`. An emptied
namespace stays registered: engines keep storing into it.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import click

TOKEN_ENV = "KVTIER_TOKEN"

_url = click.option("--url", required=True, help="The daemon: http://host:port, https://... or unix:///path.")
_token = click.option("--token", envvar=TOKEN_ENV, default=None, help=f"Admin token of the daemon (env {TOKEN_ENV}).")
_tenant = click.option("--tenant", default=None, help="Tenant of the namespace (default: the token's own).")


def _namespace_option(required: bool) -> Callable:
    return click.option("--namespace", "namespace", default=None, required=required,
                        help="Namespace id: 64 lowercase hex digits (`kvtier admin ls` lists them).")


@click.group("admin")
def admin() -> None:
    """A daemon's namespaces (admin token): list, empty, delete."""


def _run(url: str, token: str | None, fn: Callable[[Any], Any]) -> Any:
    """``fn(client)`` with the errors of an admin call as one-line CLI errors."""
    from kvtier.tiers.daemon_client import DaemonClient

    try:
        client = DaemonClient(url, token=token, timeout_s=5.0)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        return fn(client)
    except PermissionError as exc:
        raise click.ClickException(f"{exc} (an admin token is needed: --token or env {TOKEN_ENV})") from None
    except (LookupError, RuntimeError, ValueError) as exc:
        raise click.ClickException(str(exc).strip("'\"")) from None
    finally:
        client.close()


def _parse_namespace(value: str) -> bytes:
    from kvtier.checks import parse_namespace

    try:
        return parse_namespace(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--namespace") from None


@admin.command("ls")
@_url
@_token
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def ls(url: str, token: str | None, as_json: bool) -> None:
    """Every tenant's namespaces: tenant, label, namespace id, block shape, blocks per tier."""
    listed = _run(url, token, lambda client: client.namespaces())
    if as_json:
        click.echo(json.dumps(listed, indent=2))
        return
    if not listed:
        click.echo("no namespaces")
        return
    click.echo(f"{'TENANT':<16} {'LABEL':<32} {'NAMESPACE':<64}  {'DTYPE':<14} BLOCKS")
    for entry in sorted(listed, key=lambda e: (e.get("tenant", ""), e.get("label", ""))):
        usage = entry.get("usage") or {}
        blocks = " ".join(f"{tier} {u.get('blocks', 0)}" for tier, u in usage.items()
                          if isinstance(u, dict)) or "n/a"
        click.echo(f"{entry.get('tenant', '?'):<16} {entry.get('label', '?'):<32} {entry.get('namespace', '?'):<64}  "
                   f"{entry.get('dtype', '?'):<14} {blocks}")


@admin.command("clear")
@_url
@_token
@_namespace_option(required=False)
@_tenant
@click.option("--all", "all_", is_flag=True, help="Empty every namespace of every tenant.")
@click.option("--yes", is_flag=True, help="Do not ask before --all.")
def clear(url: str, token: str | None, namespace: str | None, tenant: str | None, all_: bool, yes: bool) -> None:
    """Empty a namespace (or --all), every tier; it stays registered. Cuts its calls in flight."""
    if all_ == (namespace is not None):
        raise click.UsageError("give --namespace or --all")
    if all_:
        if tenant is not None:
            raise click.UsageError("--tenant goes with --namespace, not --all")
        if not yes:
            click.confirm(f"Empty every namespace of every tenant on {url}?", abort=True)
        n = _run(url, token, lambda client: client.reset())
        click.echo(f"emptied {n} namespace{'s' if n != 1 else ''}")
        return
    ns = _parse_namespace(namespace)
    _run(url, token, lambda client: client.reset(ns, tenant=tenant))
    click.echo(f"emptied {namespace}" + (f" of tenant {tenant}" if tenant else ""))


@admin.command("rm")
@_url
@_token
@_namespace_option(required=True)
@_tenant
@click.option("--yes", is_flag=True, help="Do not ask.")
def rm(url: str, token: str | None, namespace: str, tenant: str | None, yes: bool) -> None:
    """Delete a namespace and all its blocks (engines that use it register it again)."""
    ns = _parse_namespace(namespace)
    if not yes:
        click.confirm(f"Delete namespace {namespace}" + (f" of tenant {tenant}" if tenant else "") + f" on {url}?",
                      abort=True)
    _run(url, token, lambda client: client.delete(ns, tenant=tenant))
    click.echo(f"deleted {namespace}" + (f" of tenant {tenant}" if tenant else ""))
