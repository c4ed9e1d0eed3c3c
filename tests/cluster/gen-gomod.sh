#!/usr/bin/env bash
# Regenerate go.mod and go.sum of this module for a Kubernetes and etcd release:
#   tests/cluster/gen-gomod.sh v1.34.4 v3.6.4
# k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/client-go, ...) at
# v0.0.0 and maps them to directories of its own tree with a replace block; a module that
# depends on it needs one replace line per staging module, mapping it to the published
# v0.<minor>.<patch>. Those lines are derived here from the release's own go.mod, so a
# version bump can never leave a staging module out or keep a stale one.
set -euo pipefail
cd "$(dirname "$0")"

kube_version=${1:?usage: gen-gomod.sh KUBE_VERSION ETCD_VERSION}
etcd_version=${2:?usage: gen-gomod.sh KUBE_VERSION ETCD_VERSION}
export GOWORK=off GOTOOLCHAIN=local GOFLAGS=-mod=mod

# v1.34.4 -> v0.34.4: the staging modules are tagged with the major version dropped.
staging_version="v0.${kube_version#v1.}"

upstream_gomod=$(go mod download -json "k8s.io/kubernetes@${kube_version}" |
	python3 -c 'import json, sys; print(json.load(sys.stdin)["GoMod"])')

replace_lines=$(go mod edit -json "$upstream_gomod" | python3 -c '
import json, sys
staging_version = sys.argv[1]
for r in json.load(sys.stdin).get("Replace") or []:
    old, new = r["Old"]["Path"], r["New"]
    if new["Path"].startswith("./staging/"):
        print("%s=%s@%s" % (old, old, staging_version))
    elif "Version" in new:
        print("%s=%s@%s" % (old, new["Path"], new["Version"]))
    else:
        sys.exit("unexpected directory replace %s => %s in the k8s.io/kubernetes go.mod" % (old, new["Path"]))
' "$staging_version")

go_line=$(go mod edit -json "$upstream_gomod" | python3 -c 'import json, sys; print(json.load(sys.stdin)["Go"])')

rm -f go.mod go.sum
go mod init shardcache/tests/cluster
go mod edit -go="$go_line"
# The release pins its runtime behaviour with godebug lines; the main module decides them.
go mod edit -json "$upstream_gomod" | python3 -c '
import json, sys
for g in json.load(sys.stdin).get("GoDebug") or []:
    print("%s=%s" % (g["Key"], g["Value"]))
' | while read -r kv; do go mod edit -godebug="$kv"; done
while read -r rep; do go mod edit -replace="$rep"; done <<<"$replace_lines"
go mod edit -require="k8s.io/kubernetes@${kube_version}"
go mod edit -require="go.etcd.io/etcd/server/v3@${etcd_version}"
go mod tidy
echo "wrote go.mod and go.sum for k8s.io/kubernetes ${kube_version}, etcd ${etcd_version}" >&2
