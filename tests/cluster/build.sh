#!/usr/bin/env bash
# Build one Go-built test tool into a versioned directory outside the repo:
#   build.sh kubernetes VERSION DEST   kube-apiserver, kube-controller-manager,
#                                      kube-scheduler, kubectl (k8s.io/kubernetes in go.mod)
#   build.sh kubenode VERSION DEST     kubelet, kube-proxy (the same module: the real node)
#   build.sh etcd VERSION DEST         etcd (go.etcd.io/etcd/server/v3 in go.mod)
#   build.sh helm VERSION DEST     helm.sh/helm/v3/cmd/helm
#   build.sh kwok VERSION DEST     sigs.k8s.io/kwok/cmd/kwok
#   build.sh minio VERSION DEST    github.com/minio/minio
#   build.sh prometheus VERSION DEST   prometheus and promtool
#                                      (github.com/prometheus/prometheus cmd/...)
# The binaries land in DEST.tmp first and DEST appears only when all of them are built,
# so an interrupted build is redone rather than half-used. Builds run under `nice`: the
# machine has two cores that tests and other work share.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

export GOWORK=off GOTOOLCHAIN=local CGO_ENABLED=0
# -s -w: no symbol tables; these binaries are only run, never debugged, and it halves them.
strip_flags="-s -w"

what=${1:?usage: build.sh kubernetes|kubenode|etcd|helm|kwok|minio|prometheus VERSION DEST}
version=${2:?VERSION}
dest=${3:?DEST}

# `go mod download -json` of one module version, run outside any module.
module_json() {
	(cd / && go mod download -json "$1")
}

# The kubernetes and etcd builds use this module's go.mod; a version asked for that it
# does not pin means versions.env and go.mod disagree, and building anyway would cache
# one version under the other's name.
check_pinned() {
	local pinned
	pinned=$(cd "$here" && go list -m -f '{{.Version}}' "$1")
	if [[ "$pinned" != "$version" ]]; then
		echo "build.sh: asked for $1 $version but tests/cluster/go.mod pins $pinned;" \
			"run tests/cluster/gen-gomod.sh or fix tests/cluster/versions.env" >&2
		exit 2
	fi
}

kube_ldflags() {
	local version=$1 info build_date major minor rest
	# The release's own timestamp, so a rebuild yields the same version report.
	info=$(module_json "k8s.io/kubernetes@${version}" |
		python3 -c 'import json, sys; print(json.load(sys.stdin)["Info"])')
	build_date=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["Time"])' "$info")
	rest=${version#v}
	major=${rest%%.*}
	rest=${rest#*.}
	minor=${rest%%.*}
	local flags="$strip_flags" pkg
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		# The source archive carries no commit id; an empty one is honest, "$Format:%H$" is not.
		flags+=" -X ${pkg}.gitVersion=${version} -X ${pkg}.gitMajor=${major}"
		flags+=" -X ${pkg}.gitMinor=${minor} -X ${pkg}.gitCommit="
		flags+=" -X ${pkg}.gitTreeState=archive -X ${pkg}.buildDate=${build_date}"
	done
	echo "$flags"
}

# One build at a time per machine: each wants both cores, and two builds of the same
# tool would race on DEST.tmp. Whoever waited finds the work done and stops.
mkdir -p "$(dirname "$dest")"
exec 9>"$(dirname "$dest")/.build.lock"
flock 9
if [[ -d "$dest" ]]; then
	echo "build.sh: $dest already built" >&2
	exit 0
fi

finish() {
	local dest=$1
	rm -rf "$dest"
	mv "$dest.tmp" "$dest"
	echo "built $(ls "$dest" | tr '\n' ' ')into $dest" >&2
}

case "$what" in
kubernetes)
	check_pinned k8s.io/kubernetes
	rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
	(cd "$here" && nice -n 10 go build -trimpath -ldflags "$(kube_ldflags "$version")" -o "$dest.tmp/" \
		k8s.io/kubernetes/cmd/kube-apiserver \
		k8s.io/kubernetes/cmd/kube-controller-manager \
		k8s.io/kubernetes/cmd/kube-scheduler \
		k8s.io/kubernetes/cmd/kubectl)
	finish "$dest"
	;;
kubenode)
	# A separate cache entry from `kubernetes`, so the control plane alone (every e2e
	# test but the node tier) never waits for these; the shared Go build cache makes
	# this an incremental build of the kubelet's own packages.
	check_pinned k8s.io/kubernetes
	rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
	(cd "$here" && nice -n 10 go build -trimpath -ldflags "$(kube_ldflags "$version")" -o "$dest.tmp/" \
		k8s.io/kubernetes/cmd/kubelet \
		k8s.io/kubernetes/cmd/kube-proxy)
	finish "$dest"
	;;
etcd)
	check_pinned go.etcd.io/etcd/server/v3
	rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
	(cd "$here" && nice -n 10 go build -trimpath -ldflags "$strip_flags" -o "$dest.tmp/etcd" ./cmd/etcd)
	finish "$dest"
	;;
prometheus)
	# remove_all_sd: the tests scrape static targets on loopback, so none of the cloud
	# service-discovery plugins (AWS, Azure, GCE, Kubernetes, ...) is compiled; that is
	# most of Prometheus's dependency tree. No builtinassets tag: the web UI's assets are
	# a Node build we do not need, the HTTP API is all the tests use.
	ldflags="$strip_flags"
	for v in Version=${version} Branch=archive Revision=; do
		ldflags+=" -X github.com/prometheus/common/version.${v}"
	done
	rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
	(cd "$dest.tmp" && GOBIN="$dest.tmp" nice -n 10 go install -trimpath -tags remove_all_sd \
		-ldflags "$ldflags" \
		"github.com/prometheus/prometheus/cmd/prometheus@$version" \
		"github.com/prometheus/prometheus/cmd/promtool@$version")
	finish "$dest"
	;;
helm | kwok | minio)
	ldflags=$strip_flags
	case "$what" in
	helm)
		pkg=helm.sh/helm/v3/cmd/helm
		# What `helm version` reports, and the Kubernetes version `helm template` and
		# `helm lint` assume without a cluster: helm's own Makefile sets both; without
		# them a chart sees Kubernetes v1.20.
		kube_minor=$(module_json "helm.sh/helm/v3@${version}" |
			python3 -c 'import json, sys; print(json.load(sys.stdin)["GoMod"])' |
			xargs grep -m1 -E '^\s*k8s.io/client-go ' | sed -E 's/.* v0\.([0-9]+)\..*/\1/')
		ldflags+=" -X helm.sh/helm/v3/internal/version.version=${version}"
		ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=archive"
		for pkg_var in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
			ldflags+=" -X ${pkg_var}.k8sVersionMajor=1 -X ${pkg_var}.k8sVersionMinor=${kube_minor}"
		done
		;;
	kwok) pkg=sigs.k8s.io/kwok/cmd/kwok ;;
	minio) pkg=github.com/minio/minio ;;
	esac
	rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
	# Outside any module, so the tool's own go.mod decides its dependencies.
	(cd "$dest.tmp" && GOBIN="$dest.tmp" nice -n 10 go install -trimpath -ldflags "$ldflags" "$pkg@$version")
	if [[ "$what" == kwok ]]; then
		# kwok runs no stage unless given some: keep the release's "fast" set (nodes
		# initialise and heartbeat through a Lease, pods go Running, Job pods Succeeded,
		# deleted pods go away) next to the binary, where tests/cluster/cluster.py finds it.
		src=$(module_json "sigs.k8s.io/kwok@${version}" |
			python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')/kustomize/stage
		mkdir -p "$dest.tmp/stages"
		cp "$src/node/fast/node-initialize.yaml" \
			"$src/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
			"$src/pod/fast/pod-ready.yaml" "$src/pod/fast/pod-complete.yaml" \
			"$src/pod/fast/pod-delete.yaml" "$dest.tmp/stages/"
	fi
	finish "$dest"
	;;
*)
	echo "build.sh: unknown tool '$what' (expected kubernetes, kubenode, etcd, helm, kwok, minio or prometheus)" >&2
	exit 2
	;;
esac
