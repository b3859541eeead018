/** An operation as the ledger answered it: every field of the API's operation as a property
 * (operation_id, state, version, idempotency_key, result, ...); `.data` is the whole answer;
 * `.replayed` is true when the ledger served it from the stored receipt (a repeat of an
 * earlier call: nothing was recorded or sent for this request). */
export class Receipt {
  constructor(data) {
    const { replayed, ...fields } = data;
    Object.assign(this, fields);
    Object.defineProperty(this, "data", { value: data, enumerable: false });
    Object.defineProperty(this, "replayed", { value: replayed === true, enumerable: false });
  }

  toString() {
    return `<Receipt ${this.data.operation_id} ${this.data.operation} ${this.data.state} v${this.data.version}>`;
  }
}
