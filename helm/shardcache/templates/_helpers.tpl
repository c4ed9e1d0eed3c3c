{{/* Names and labels shared by every template. */}}

{{- define "shardcache.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "shardcache.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "shardcache.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "shardcache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "shardcache.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "shardcache.webhookServiceName" -}}
{{- printf "%s-webhook" (include "shardcache.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "shardcache.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "shardcache.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "shardcache.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{- define "shardcache.sidecarImage" -}}
{{- printf "%s:%s" .Values.sidecar.image.repository (default .Chart.AppVersion .Values.sidecar.image.tag) -}}
{{- end -}}

{{/* True (non-empty) when the API server calls the in-cluster Service, not webhook.url. */}}
{{- define "shardcache.webhookInCluster" -}}
{{- if and .Values.webhook.enabled (not .Values.webhook.url) -}}true{{- end -}}
{{- end -}}

{{/*
The operator's namespaced permissions, shared by the ClusterRole (all namespaces) and
the per-namespace Roles (operator.watchNamespaces). Why each is needed:
  datasetmounts get/list/watch: the objects it reconciles (kopf watches them);
  datasetmounts patch: its finalizer and kopf's progress annotations;
  datasetmounts/status patch: phase, conditions, pinned digest, attachedPods;
  pods list/watch: the index that counts attached pods (never get, never write:
    injection happens in the admission response, not by patching pods);
  events create: the Events users see in `kubectl describe dsm`.
*/}}
{{- define "shardcache.namespacedRules" -}}
- apiGroups: [shardcache.io]
  resources: [datasetmounts]
  verbs: [get, list, watch, patch]
- apiGroups: [shardcache.io]
  resources: [datasetmounts/status]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/*
Fail early, naming what is missing, when the values lack a map that the templates read
keys of: `helm upgrade --reuse-values` from an older chart keeps that release's values,
which predate maps added since (nodeCache, policy, monitoring, ...), and the templates
would stop at a nil pointer instead. templates/checks/values.yaml runs it first (helm
renders deeper paths first). tests/e2e/test_chart.py nulls each map to prove the list
complete.
*/}}
{{- define "shardcache.checkValues" -}}
{{- $missing := list -}}
{{- range $path := list "operator" "operator.image" "operator.spread" "operator.podDisruptionBudget" "operator.settings" "sidecar" "sidecar.image" "policy" "peering" "serviceAccount" "rbac" "webhook" "webhook.certManager" "metrics" "networkPolicy" "networkPolicy.metricsPorts" "nodeCache" "nodeCache.reclaim" "uninstallGuard" "monitoring" "monitoring.podMonitor" "monitoring.rules" "monitoring.rules.dataStall" "monitoring.rules.notReady" "monitoring.rules.sourceErrors" "monitoring.rules.sidecarNotReady" "monitoring.rules.tierUnusable" "monitoring.dashboard" -}}
{{- $node := $.Values -}}
{{- range $key := splitList "." $path -}}
{{- $node = ternary (get (kindIs "map" $node | ternary $node dict) $key) nil (kindIs "map" $node) -}}
{{- end -}}
{{- if not (kindIs "map" $node) -}}
{{- $missing = append $missing $path -}}
{{- end -}}
{{- end -}}
{{- if $missing -}}
{{- fail (printf "the values lack %s, which this chart (%s) reads: they are an older chart's, as `helm upgrade --reuse-values` keeps them. Upgrade with --reset-then-reuse-values (helm 3.14 or later: this chart's defaults, then your earlier values and flags on top), or give your values files again (-f) without --reuse-values; docs/operator.md, \"Upgrading\"" (join ", " $missing) .Chart.Version) -}}
{{- end -}}
{{- end -}}

{{/*
The node-cache DaemonSet's volume name and mount point of its node path number `.`
(0: nodeCache.path, as charts before named it; then the other policy.nodePaths entries):
an index, never the path, which may be longer than a volume name (a DNS label) and
holds characters one may not (templates/node-cache.yaml).
*/}}
{{- define "shardcache.nodeCacheVolume" -}}
{{- if eq (int .) 0 -}}node-cache{{- else -}}node-cache-{{ . }}{{- end -}}
{{- end -}}

{{- define "shardcache.nodeCacheMount" -}}
/{{ include "shardcache.nodeCacheVolume" . }}
{{- end -}}
