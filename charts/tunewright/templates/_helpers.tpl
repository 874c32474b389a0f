{{/* Names: the release's, cut to what Kubernetes accepts. */}}
{{- define "tunewright.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tunewright.labels" -}}
app.kubernetes.io/name: tunewright
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tunewright.selector" -}}
app.kubernetes.io/name: tunewright
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tunewright.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "tunewright.workerImage" -}}
{{ .Values.workerImage.repository }}:{{ .Values.workerImage.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "tunewright.apiURL" -}}
{{- .Values.api.internalURL | default (printf "http://%s-api.%s.svc:%d" (include "tunewright.fullname" .) .Release.Namespace (int .Values.api.service.port)) -}}
{{- end -}}

{{- define "tunewright.databaseSecret" -}}
{{- .Values.database.bundled.existingSecret | default (printf "%s-database" (include "tunewright.fullname" .)) -}}
{{- end -}}

{{- define "tunewright.adminSecret" -}}
{{- .Values.adminToken.existingSecret | default (printf "%s-admin-token" (include "tunewright.fullname" .)) -}}
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
