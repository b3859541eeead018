from django.shortcuts import redirect


def queue(request):
    return redirect("admin:ledger_operation_changelist")


def operation_detail(request, operation_id):
    from django.shortcuts import get_object_or_404

    from ledger.models import Operation

    op = get_object_or_404(Operation, operation_id=operation_id)
    return redirect("admin:ledger_operation_change", op.pk)
