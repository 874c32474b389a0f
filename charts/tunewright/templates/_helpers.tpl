{{/*
The release's name made fit for every kind: dots become dashes, and a name starting with a digit gets the
chart's name in front (a Service's name is a DNS-1035 label: a letter first, no dot); cut to 50 characters, so
that "<fullname>-<component>" fits in 63 for the chart's components. Object names come from
tunewright.objectName, never from this alone.
*/}}
{{- define "tunewright.fullname" -}}
{{- $release := .Release.Name | replace "." "-" -}}
{{- $full := printf "%s-%s" $release .Chart.Name -}}
{{- if not (regexMatch "^[a-z]" $release) -}}
{{- $full = printf "%s-%s" .Chart.Name $release -}}
{{- else if contains .Chart.Name $release -}}
{{- $full = $release -}}
{{- end -}}
{{- $full | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/*
One object's name, "<fullname>-<component>", at most `limit` characters: 63 unless given (a DNS label, what
a Service's name and a pod's host name must be); a Secret gives 253 (a DNS subdomain); a StatefulSet gives
52, as its pods carry the label controller-revision-hash=<name>-<hash of up to 10 characters>, a label value
of at most 63. A name that does not fit keeps its component whole and ends the cut fullname with a hash of
it, so that two long release names still make two names.
Call: include "tunewright.objectName" (list . "api"), or (list . "postgresql" 52).
*/}}
{{- define "tunewright.objectName" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $limit := 63 -}}
{{- if gt (len .) 2 }}{{ $limit = int (index . 2) }}{{ end -}}
{{- $full := include "tunewright.fullname" $root -}}
{{- $name := printf "%s-%s" $full $component -}}
{{- if gt (len $name) $limit -}}
{{- $hash := sha256sum $full | trunc 6 -}}
{{- $kept := sub $limit (add (len $component) (len $hash) 2) -}}
{{- $name = printf "%s-%s-%s" ($full | trunc (int $kept) | trimSuffix "-") $hash $component -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "tunewright.labels" -}}
app.kubernetes.io/name: tunewright
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "tunewright.selector" -}}
app.kubernetes.io/name: tunewright
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* An image reference from a values block: repository, tag (empty: appVersion) and digest (optional). */}}
{{- define "tunewright.imageOf" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- $image.repository }}:{{ $image.tag | default $root.Chart.AppVersion }}{{ with $image.digest }}@{{ . }}{{ end -}}
{{- end -}}

{{- define "tunewright.image" -}}
{{- include "tunewright.imageOf" (list .Values.image .) -}}
{{- end -}}

{{- define "tunewright.workerImage" -}}
{{- include "tunewright.imageOf" (list .Values.workerImage .) -}}
{{- end -}}

{{- define "tunewright.apiURL" -}}
{{- .Values.api.internalURL | default (printf "http://%s.%s.svc:%d" (include "tunewright.objectName" (list . "api")) .Release.Namespace (int .Values.api.service.port)) -}}
{{- end -}}

{{- define "tunewright.databaseSecret" -}}
{{- .Values.database.bundled.existingSecret | default (include "tunewright.objectName" (list . "database" 253)) -}}
{{- end -}}

{{- define "tunewright.adminSecret" -}}
{{- .Values.adminToken.existingSecret | default (include "tunewright.objectName" (list . "admin-token" 253)) -}}
{{- end -}}

{{- define "tunewright.metricsSecret" -}}
{{- .Values.metrics.token.existingSecret | default (include "tunewright.objectName" (list . "metrics-token" 253)) -}}
{{- end -}}

{{- define "tunewright.jobTokenKeySecret" -}}
{{- .Values.operator.jobTokenKey.existingSecret | default (include "tunewright.objectName" (list . "job-token-key" 253)) -}}
{{- end -}}

{{/*
What the operator does with a job's ConfigMap and Secret: creates and deletes them (one an earlier reconcile
left is replaced), and never reads either (no get, list or watch: the admin token, every job's token and
other tenants' configuration stay out of its reach).
*/}}
{{- define "tunewright.operatorJobObjectRules" -}}
- apiGroups: [""]
  resources: ["configmaps", "secrets"]
  verbs: ["create", "delete"]
{{- end -}}

{{/* Pod Security Standard "restricted", for every pod and container of the chart. */}}
{{- define "tunewright.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tunewright.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* A Secret's value kept across upgrades: the existing one's, else a new random one. */}}
{{- define "tunewright.keptSecretValue" -}}
{{- $existing := lookup "v1" "Secret" .namespace .name -}}
{{- if and $existing (hasKey $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
{{- end -}}
