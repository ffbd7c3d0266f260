{{- define "tensorgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tensorgate.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tensorgate.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tensorgate.secretName" -}}
{{- .Values.credentials.existingSecret | default (printf "%s-credentials" (include "tensorgate.fullname" .)) -}}
{{- end -}}

{{/* Bytes of memory a pod needs: the inference budget, the memory cache and the overhead. */}}
{{- define "tensorgate.memoryBytes" -}}
{{- $pd := .Values.config.pushdown | default dict -}}
{{- $cache := $pd.cache | default dict -}}
{{- add (int64 ($pd.memory_budget | default 1073741824)) (int64 ($cache.memory_bytes | default 268435456)) (int64 .Values.memoryOverheadBytes) -}}
{{- end -}}

{{/* Helm reads every number in values as a float; the gateway's keys are integers. Turns whole
floats back into integers, in place, at every depth. */}}
{{- define "tensorgate.intify" -}}
{{- range $k, $v := . -}}
{{- if kindIs "map" $v -}}
{{- include "tensorgate.intify" $v -}}
{{- else if and (kindIs "float64" $v) (eq (floor $v) $v) -}}
{{- $_ := set $ $k (int64 $v) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* `identity`, checked: "transparent" or "terminating". */}}
{{- define "tensorgate.identity" -}}
{{- if not (has .Values.identity (list "transparent" "terminating")) -}}
{{- fail (printf "identity must be \"transparent\" or \"terminating\", not %q" (toString .Values.identity)) -}}
{{- end -}}
{{- .Values.identity -}}
{{- end -}}
